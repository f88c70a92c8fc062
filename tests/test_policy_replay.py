"""`bench.tools.policy_replay`: a round replayed as the engine runs it, and priced by its forwards."""

import numpy as np
import pytest

from jspec import rounds
from bench.tools import policy_replay as pr

# Seconds that make each round's price easy to read: a draft step 1, a
# verify of T positions 10 T, a target step 10.
COSTS = pr.Costs(target_step=10.0, draft_step=1.0, verify={t: 10.0 * t for t in range(2, 10)})


def test_fixed_gamma_on_a_fully_predicted_path_is_priced_by_its_forwards():
  y = np.arange(10)
  a, c = y.copy(), np.full(10, 0.1)  # every draft right, however unsure
  r = pr.replay(a, c, y, pr.fixed(), 2, 2, False, COSTS)
  assert r["rounds"] == 3 and r["tokens_per_round"] == 3.0 and r["acceptance"] == 1.0
  assert r["seconds"] == 3 * (2 * 1.0 + 30.0)
  assert r["speedup"] == pytest.approx(9 * 10.0 / r["seconds"])


def test_the_cumulative_rule_stops_at_a_wrong_draft_too():
  y = np.arange(12)
  a = y.copy()
  a[3] = 99  # the round at 1 drafts y[1], y[2] right and y[3] wrong
  assert rounds.replay_round(a == y, np.ones(12), 1, pr.cumulative(0.5), 8, 8, True)[0] == 3


def test_costs_from_refuses_what_it_cannot_price():
  doc = {"target_step_s": 0.05, "draft_step_s": 0.02,
         "verify_s": {str(t): 0.05 + 0.01 * t for t in range(2, 10)}}
  assert pr.costs_from({"costs": doc}).verify[9] == pytest.approx(0.14)
  with pytest.raises(ValueError, match="lacks widths \\[9\\]"):
    pr.costs_from({**doc, "verify_s": {str(t): 0.1 for t in range(2, 9)}})
  with pytest.raises(ValueError, match="positive"):
    pr.costs_from({**doc, "draft_step_s": 0})
  with pytest.raises(ValueError, match="expected target_step_s"):
    pr.costs_from({"draft_step_s": 0.02})


def test_replays_an_earlier_documents_paths_without_a_model(tmp_path, capsys):
  y = list(range(20))
  paths = [{"prompt": "p", "kind": "code", "path": {"y": y, "a": y, "c": [0.99] * 20}},
           {"prompt": "q", "kind": "chat", "path": {"y": y, "a": [0] * 20, "c": [0.2] * 20}}]
  source = tmp_path / "paths.json"
  source.write_text(__import__("json").dumps({"per_prompt": paths, "costs": {
      "target_step_s": 10.0, "draft_step_s": 1.0,
      "verify_s": {str(t): 10.0 * t for t in range(2, 10)}}}))
  out = tmp_path / "out.json"
  assert pr.main(["--from", str(source), "--out", str(out)]) == 0
  doc = __import__("json").loads(out.read_text())
  assert doc["summary"]["code"]["fixed2"]["tokens_per_round"] == pytest.approx(19 / 7)
  assert doc["summary"]["chat"]["fixed2"]["tokens_per_round"] == 1.0  # every draft wrong
  assert doc["costs"]["verify_s"]["9"] == 90.0
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(SystemExit):
    pr.main(["--from", str(tmp_path / "bad.json"), "--out", str(out)])
  assert "expected a readable JSON document" in capsys.readouterr().err


def test_check_pairs_a_one_cap_sweeps_names_with_that_cap():
  y = list(range(12))
  rows = pr.replay_all([{"prompt": "p", "kind": "code",
                         "path": {"y": y, "a": y, "c": [0.99] * 12}}], COSTS)
  run = lambda tpr: {"tok_s": 20.0, "tokens_per_round": tpr, "ids": y}
  record = {"prompt": "p", "kind": "code", "rep": 0, "order": [], "target": run(1.0),
            "c0.7": run(3.0)}
  assert set(pr.check(rows, {"gammas": [5], "records": [record]})["code"]) == {"c0.7_g5"}
  assert set(pr.check(rows, {"records": [record]})["code"]) == {"c0.7_g8"}  # before caps were recorded
  got = pr.check(rows, {"gammas": [2], "records": [record]})["code"]["c0.7_g2"]
  assert got["tpr_replay"] == rows[0]["c0.7_g2"]["tokens_per_round"] and got["tpr_measured"] == 3.0

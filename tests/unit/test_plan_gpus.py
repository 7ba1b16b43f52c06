"""`megatron-ppo plan --gpus N` (issue 49 item 2): a layout whose TP x PP x DP ranks do not fit the N GPUs is marked
infeasible with the arithmetic, in the table (the configured row is always listed) and in --json's problems; the
plan exits 1 and prints no step time for it. Pure planner calls on configs/ppo_70b.yaml: no model is built."""
from __future__ import annotations

import json

import pytest

from megatron_ppo.plan.cli import main
from megatron_ppo.plan.layouts import fit_problems
from megatron_ppo.plan.memory import Layout


def _plan(capsys, *args):
    rc = main(list(args))
    return rc, capsys.readouterr().out


def test_fit_problems_by_hand():
    assert fit_problems(Layout(8, 4, 4), 128) == []
    assert fit_problems(Layout(8, 4, 1), 8) == ["TP8 x PP4 x DP1 = 32 ranks > 8 GPUs (one rank per GPU)"]
    assert "does not divide 48 GPUs" in fit_problems(Layout(8, 4, 1), 48)[0]  # the driver's for_world refuses it
    assert fit_problems(Layout(8, 4, 1), 48, dp_fixed=True) == []  # a fixed DP may leave GPUs idle
    assert "64 ranks > 32 GPUs" in fit_problems(Layout(8, 4, 2), 32, dp_fixed=True)[0]


@pytest.mark.parametrize("gpus", [8, 16])
def test_70b_on_too_few_gpus_is_refused_in_the_json(capsys, gpus):
    rc, out = _plan(capsys, "--config", "ppo_70b", "--gpus", str(gpus), "--json")
    d = json.loads(out)
    why = f"TP8 x PP4 x DP1 = 32 ranks > {gpus} GPUs"
    assert rc == 1 and not d["fits"] and d["gpus"] == gpus
    for role in ("actor", "critic", "ref"):
        assert any(p.startswith(f"{role}: {why}") for p in d["problems"]), d["problems"]
        assert any(why in p for p in d["configured"][role]["problems"])
        row = next(r for r in d["layouts"][role] if (r["tp"], r["pp"]) == (8, 4))  # listed, with the reason
        assert not row["feasible"] and any(why in p for p in row["problems"])
    assert d["step_time_s"] is None and d["comm_s"] is None
    assert any(why in p for p in d["step_time_not_estimated"])


def test_70b_on_8_gpus_text_marks_the_configured_row_and_prints_no_step_time(capsys):
    rc, out = _plan(capsys, "--config", "ppo_70b", "--gpus", "8")
    assert rc == 1
    assert "--gpus 8 in place of the config's 16 node(s) x 8 = 128 GPUs" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith("* TP8 PP4 DP1")]
    assert len(rows) == 3 and all(line.endswith("TP8 x PP4 x DP1 = 32 ranks > 8 GPUs (one rank per GPU)")
                                  for line in rows), rows
    assert "estimated step time: none: the configured layouts cannot run on 8 GPUs" in out
    assert "per step" not in out and "tokens/s" not in out


def test_gpus_that_tp_x_pp_does_not_divide_are_refused(capsys):
    rc, out = _plan(capsys, "--config", "ppo_70b", "--gpus", "48", "--json")
    d = json.loads(out)
    assert rc == 1 and d["step_time_s"] is None
    assert "actor: TP8 x PP4 = 32 does not divide 48 GPUs" in d["problems"][0]


def test_a_fixed_data_parallel_size_is_kept_and_checked(capsys):
    """cluster.<role>.data_parallel_size stays as configured on --gpus (it used to be recomputed to fill them)."""
    rc, out = _plan(capsys, "--config", "ppo_70b", "--gpus", "64", "--json", "cluster.actor.data_parallel_size=4")
    d = json.loads(out)
    assert rc == 1 and d["configured"]["actor"]["layout"].startswith("TP8 PP4 DP4")
    assert d["problems"] == ["actor: TP8 x PP4 x DP4 = 128 ranks > 64 GPUs (one rank per GPU)"]
    assert d["configured"]["critic"]["layout"].startswith("TP8 PP4 DP2") and not d["configured"]["critic"]["problems"]
    rc, out = _plan(capsys, "--config", "ppo_70b", "--json", "cluster.actor.data_parallel_size=2")  # 64 of 128
    d = json.loads(out)
    assert rc == 0 and d["fits"] and d["configured"]["actor"]["layout"].startswith("TP8 PP4 DP2")
    assert d["step_time_s"]["step"] > 0


def test_split_placement_adds_up_the_roles_ranks(capsys):
    rc, out = _plan(capsys, "--config", "ppo_70b", "--json", "cluster.placement=split")
    d = json.loads(out)
    assert rc == 1 and "split placement: actor 128 + critic 128 + ref 128 = 384 ranks > 128 GPUs" in d["problems"]
    assert d["step_time_s"] is None


def test_vllm_is_not_planned_for_a_layout_that_cannot_run(capsys):
    rc, out = _plan(capsys, "--config", "ppo_70b", "--gpus", "8", "--json", "rollout.name=vllm")
    v = json.loads(out)["vllm"]
    assert rc == 1 and "cannot run on these GPUs" in v["error"] and "total" not in v


def test_the_help_says_what_gpus_replaces(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "in place of the config's cluster.nnodes x cluster.n_gpus_per_node" in text
    assert "TP x PP x DP must fit N" in text

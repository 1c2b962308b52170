"""Search budgets as options: ``plan --trials/--population`` for genetic, ``--hint`` for ilp, ``plan --json``'s
``search`` section, and bad options as one-line usage errors."""

from __future__ import annotations

import json

import pytest

from spiderflow.cli.main import main
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement.genetic import GeneticPolicy
from spiderflow.core.placement.ilp import IlpPolicy
from spiderflow.core.placement.options import SearchOptions, make_policy


def test_make_policy_applies_options_where_a_policy_takes_them() -> None:
    ga = make_policy("genetic", SearchOptions(trials=7, population=3))
    assert isinstance(ga, GeneticPolicy) and (ga.trials, ga.population) == (7, 3)
    ilp = make_policy("ilp-decomposed", SearchOptions(hint="own"))
    assert isinstance(ilp, IlpPolicy) and ilp.hint_policies == () and ilp.decomposed
    assert make_policy("firstfit", SearchOptions(trials=7, hint="own")).name == "firstfit"
    with pytest.raises(ValidationError, match="trials"):
        SearchOptions(trials=-1)
    with pytest.raises(ValidationError, match="population"):
        SearchOptions(population=0)


def test_plan_json_reports_what_the_genetic_search_did(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", "aws-10-dtfm", "--model", "gpt3-1.3b", "--gpus", "4", "--policy", "genetic",
                 "--trials", "6", "--population", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["search"]["trials"] == 6 and doc["search"]["population"] == 4
    assert doc["search"]["evaluations"] >= 1 and doc["step_time_s"] <= doc["search"]["initial_step_s"]


def test_plan_json_reports_the_solver_and_the_finishing_step_of_ilp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", "aws-10-dtfm", "--model", "gpt3-1.3b", "--gpus", "4", "--policy", "ilp",
                 "--time-limit", "2", "--json"]) == 0
    search = json.loads(capsys.readouterr().out)["search"]
    assert {"cp_status", "hint_in_model", "finish", "finish_s"} <= set(search)
    assert search["finish"] in (0, 1, 2) and search["finish_s"] >= 0


@pytest.mark.parametrize(("args", "flag"), [(["--policy", "ilp", "--hint", "nosuch"], "--hint"),
                                             (["--policy", "genetic", "--trials", "-1"], "--trials")])
def test_bad_search_options_are_usage_errors(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--topology", "aws-10-dtfm", "--model", "gpt3-1.3b", "--gpus", "4", *args])
    assert rc == 2
    assert flag in capsys.readouterr().err

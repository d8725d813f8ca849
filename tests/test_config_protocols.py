"""``protocol`` is a union discriminated by ``name``: each protocol takes only its own fields, a field of
another is one line naming it, and a new name over a config (``--set protocol.name=asp``) keeps what
the user meant."""

from __future__ import annotations

import pytest

from switchps.config.protocol import AMB, ASP, SSP, Backup, Rounds
from switchps.config.run import ConfigError, load_config, parse_config


def _problems(raw: dict, overrides: list[str] = []) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(raw, overrides)
    return err.value.problems


@pytest.mark.parametrize("name, member", [("bsp", Rounds), ("fmb", Rounds), ("asp", ASP), ("ssp", SSP),
                                          ("backup", Backup)])
def test_each_name_validates_as_its_member(name, member):
    spec = parse_config({"protocol": {"name": name}}).protocol
    assert type(spec) is member and spec.name == name


def test_a_field_of_another_protocol_is_one_line_naming_it():
    assert _problems({"protocol": {"name": "asp", "batch": 8, "backup_workers": 1, "window_s": 2}}) == [
        "protocol.backup_workers: asp takes no backup_workers (a field of bsp, fmb, amb, backup, local_sgd, diloco)",
        "protocol.window_s: asp takes no window_s (a field of timed)"]
    assert _problems({"protocol": {"name": "bsp", "time_budget_s": 0.5}}) == [
        "protocol.time_budget_s: bsp takes no time_budget_s (a field of amb)"]


def test_a_typo_is_still_an_unknown_key_with_the_nearest_field():
    assert _problems({"protocol": {"name": "ssp", "stalenes": 2}}) == [
        "protocol.stalenes: unknown key (did you mean staleness?)"]


def test_required_fields_and_the_backup_bound():
    assert _problems({"protocol": {"name": "amb"}}) == ["protocol.time_budget_s: Field required"]
    assert _problems({"protocol": {"name": "backup", "backup_workers": 0}}) == [
        "protocol.backup_workers: Input should be greater than or equal to 1 (got 0)"]
    assert parse_config({"protocol": {"name": "bsp", "backup_workers": 1}}).protocol.backup_workers == 1


def test_a_new_name_drops_the_old_protocols_defaults_and_reports_what_was_set():
    """quickstart.yaml sets bsp's deadline_s to its default: a user's --set protocol.name=asp means ASP."""
    assert type(load_config(None, ["protocol.name=asp"]).protocol) is ASP
    assert type(load_config(None, ["protocol.name=amb", "protocol.time_budget_s=0.5"]).protocol) is AMB
    raw = {"protocol": {"name": "bsp", "deadline_s": 5.0, "backup_workers": 0}}
    assert _problems(raw, ["protocol.name=kasync"]) == [
        "protocol.deadline_s: kasync takes no deadline_s (a field of bsp, fmb, amb, ssp, backup, local_sgd, diloco)"]
    assert type(parse_config({"protocol": {"deadline_s": 5.0}}, ["protocol.name=ssp"]).protocol) is SSP, \
        "a field the new protocol takes carries over"


def test_a_policy_names_protocols_with_their_own_fields():
    cfg = parse_config({"policy": {"protocols": [{"name": "amb", "time_budget_s": 0.5}]}})
    assert type(cfg.policy.protocols[0]) is AMB
    assert _problems({"policy": {"protocols": [{"name": "amb", "time_budget_s": 0.5, "k": 2}, {"name": "asp"},
                                               {"name": "asp"}]}}) == [
        "policy.protocols.0.k: amb takes no k (a field of kasync)"]
    assert _problems({"policy": {"protocols": [{"name": "asp"}, {"name": "asp"}]}}) == [
        "policy.protocols: a protocol listed twice: asp"]


FLAT_SSP = {"name": "ssp", "batch": 16, "micro_batch": None, "time_budget_s": None, "max_batch": None,
            "deadline_s": 30.0, "backup_workers": 0, "excluded_pushes": "join", "staleness": 2,
            "staleness_lr": False, "k": None, "window_s": None}
"""A protocol as ``RunConfig.dump`` wrote it before the union (a run's config.yaml, which a resume reads)."""


def test_a_config_written_before_the_union_reads_as_its_member():
    spec = parse_config({"protocol": dict(FLAT_SSP)}).protocol
    assert type(spec) is SSP and (spec.batch, spec.staleness) == (16, 2)
    flat_bsp = {**FLAT_SSP, "name": "bsp", "staleness": 3}
    assert type(parse_config({"protocol": flat_bsp}, ["protocol.name=asp"]).protocol) is ASP
    assert _problems({"protocol": dict(FLAT_SSP)}, ["protocol.window_s=2"]) == [
        "protocol.window_s: ssp takes no window_s (a field of timed)"], "what a --set adds is still checked"


@pytest.mark.parametrize("name", [["bsp"], 3, None])
def test_a_name_that_is_no_string_is_one_line(name):
    assert _problems({"protocol": {"name": name}}, ["protocol.batch=4"])[0].startswith("protocol.name: ")

"""The input checks (checks.py): every config field has a rule, and a bad value gets one line
naming it."""

from dataclasses import fields

import pytest

from checks import HD, MODEL, TAH
from hd import HDConfig
from moe import ModelConfig
from tah import TaHConfig


@pytest.mark.parametrize("config, table", [(ModelConfig, MODEL), (HDConfig, HD), (TaHConfig, TAH)])
def test_each_config_check_table_covers_every_field(config, table):
    names = {f.name for f in fields(config)}
    assert sorted(names - set(table)) == []  # a field without a rule
    assert sorted(set(table) - names) == []  # a rule for no field


@pytest.mark.parametrize("config", [ModelConfig, HDConfig, TaHConfig])
def test_the_defaults_pass_their_table(config):
    config()

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


def test_the_readme_is_short_and_names_no_commit():
    """README.md is what a clone sees today: at most 200 lines, and no commit hash (history
    lives in docs/journal.md)."""
    import re
    from pathlib import Path
    text = (Path(__file__).parent / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not hashes, hashes

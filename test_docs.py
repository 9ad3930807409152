"""What RESULTS.md tells a reader about targets agrees with the numbers beside them."""

import re
from pathlib import Path

RESULTS = (Path(__file__).parent / "RESULTS.md").read_text()


def target_rows():
    """The rows of RESULTS' targets table: (section, target, measured, verdict)."""
    block = RESULTS.split("| section | target | measured | verdict |")[1].split("\n\n")[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()[2:]]


def number(text):
    return float(re.search(r"[-+]?\d+(?:\.\d+)?", text).group())


def section_text(name):
    """RESULTS' bench section `### name.` up to the next heading of any level."""
    return re.search(rf"^### {re.escape(name)}\. .*?(?=^#)", RESULTS, re.S | re.M).group()


def test_every_target_verdict_follows_from_its_numbers_and_its_section_holds_the_figure():
    rows = target_rows()
    assert len(rows) >= 10
    for section, target, measured, verdict in rows:
        op, bound = re.search(r"(<=|>=) ([\d.]+)", target).groups()
        met = number(measured) <= float(bound) if op == "<=" else number(measured) >= float(bound)
        assert verdict == ("met" if met else "missed"), (section, target, measured)
        figure = re.search(r"[-+]?\d+(?:\.\d+)?", measured).group()  # "62 s" is "| 62 |" in its table
        assert re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d.])", section_text(section)), (section, measured)


def test_every_section_that_sets_a_target_is_in_the_table():
    named = {s for s, *_ in target_rows()}
    for heading in re.findall(r"^### (\w+)\. .*target.*$", RESULTS, re.M):
        assert heading in named, heading


def test_no_text_calls_the_targets_met_when_the_table_has_a_miss():
    for section in {s for s, *_, v in target_rows() if v == "missed"}:
        text = section_text(section)
        assert not re.search(r"targets?,? (both |all )?met", text, re.I), section

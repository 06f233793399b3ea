"""README's supported-models table is the one the code gives: every architecture the tests
run against stock Transformers, with the features `model_features` reads from its modules."""

from __future__ import annotations

from pathlib import Path

from hf_paged.hf.architectures import SUPPORTED_ARCHITECTURES, model_features
from conftest import make_model
from zoo import NAMES, make_arch

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- supported-models:start -->", "<!-- supported-models:end -->"


def table() -> str:
    models = [make_model(k) for k in ("llama_gqa", "mistral_sw", "falcon_new", "falcon_mq",
                                      "falcon_alibi")]
    models += [make_arch(n) for n in NAMES]
    rows: dict[str, list[str]] = {}
    for model in models:
        features = rows.setdefault(type(model).__name__, [])
        features += [f for f in model_features(model) if f not in features]
    lines = ["| architecture | what its layers use |", "| --- | --- |"]
    lines += [f"| `{name}` | {', '.join(features) or 'standard attention'} |"
              for name, features in sorted(rows.items())]
    return "\n".join(lines)


def test_readme_table_matches_the_code():
    expected = table()
    text = README.read_text()
    assert START in text and END in text
    shown = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert shown == expected, "README.md's table should read:\n" + expected


def test_every_supported_architecture_is_in_the_table():
    assert {line.split("`")[1] for line in table().splitlines()[2:]} == set(SUPPORTED_ARCHITECTURES)

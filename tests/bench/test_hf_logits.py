"""bench/hf_logits.py covers every family the importer knows, with models of that family,
and prints a refusal as the rule's message, never as a number."""

from bench import hf_logits
from moe_fold.models.hf.config_map import FAMILIES, hf_family


def test_every_family_has_models_of_that_family():
    # A family added to FAMILIES without a model here would be missing from the table.
    assert set(hf_logits.BUILDERS) == set(FAMILIES)
    for family, builders in hf_logits.BUILDERS.items():
        assert builders, family
        for case, build in builders.items():
            # (a family may read a model_type of its own: Qwen3.5's text model is qwen3_5_moe_text)
            assert hf_family(build().config.to_dict()) == family, case


def test_markdown_shows_numbers_and_refusals_on_one_line():
    records = [dict(family="mixtral", case="a", sizes="s", layout=layout, max_abs_diff=2.5e-6)
               for layout in hf_logits.LAYOUTS]
    records[-1] = dict(records[-1], refused="ConfigError: invalid config: 1 problem\n  - model.x=3 is odd")
    del records[-1]["max_abs_diff"]
    lines = hf_logits.markdown(records).splitlines()
    assert len(lines) == 3
    assert lines[2] == ("| mixtral | a | s | 2.5e-06 | 2.5e-06 | "
                        "refused: ConfigError: invalid config: 1 problem - model.x=3 is odd |")

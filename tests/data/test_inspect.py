"""`moe-fold data inspect` (moe_fold/data/inspect.py): the format, the document count and
lengths, the first documents decoded and the token range, for every format; a raw .bin
without its dtype refused."""

import pytest

from moe_fold.cli import main as cli_main

from tests.helpers.data_formats import corpus_docs, corpus_texts, write_all_formats


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, str]:
    return write_all_formats(tmp_path_factory.mktemp("formats"), corpus_docs())


def test_inspect_reports_every_format(formats, capsys):
    for fmt, path in formats.items():
        args = ["data", "inspect", path, "--docs", "2"] + (["--dtype", "uint16"] if fmt == "raw" else [])
        assert cli_main(args) == 0, fmt
        out = capsys.readouterr().out
        assert f"format      {fmt}" in out
        assert "documents   40:" in out and "document lengths (tokens):" in out
        assert f"document 0 ({len(corpus_docs()[0])} tokens): {corpus_texts()[0]!r}" in out
        assert "all in [0, 258)" in out
    assert cli_main(["data", "inspect", formats["raw"]]) == 2
    assert "data.dtype must name its dtype" in capsys.readouterr().err

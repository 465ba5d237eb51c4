import pytest

from miles.rollout.jsonl import decoded_lines, json_object
from miles.utils.errors import MilesUserError


def test_a_line_cut_short_names_its_own_line_and_column(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"input": "a"}\n\n{"input": \n')
    lines = list(decoded_lines(str(path), "--prompt-data"))
    assert [(n, where) for n, where, _ in lines] == [(1, f"--prompt-data {path}:1"), (3, f"--prompt-data {path}:3")]
    assert json_object(*lines[0][1:]) == {"input": "a"}
    with pytest.raises(MilesUserError, match=r":3: not valid JSON \(Expecting value at column 11\)"):
        json_object(*lines[1][1:])


def test_a_line_that_is_not_an_object_or_not_utf8(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'["a"]\n\xff\n')
    lines = decoded_lines(str(path), "")
    n, where, text = next(lines)
    assert where == f"{path}:1"  # no label: the file and line alone
    with pytest.raises(MilesUserError, match="expected a JSON object, got list"):
        json_object(where, text)
    with pytest.raises(MilesUserError, match=r":2: not UTF-8 text \(byte 1 of the line\)"):
        next(lines)

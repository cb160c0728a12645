"""No source module over 500 lines (the project's style rule): a module that grows past it gets split
along a seam into modules with one job each, rather than the limit raised."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("flowgrpo", "pipelines", "reward_models", "scripts")
MAX_LINES = 500


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def oversized(root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(path relative to root, line count) of every .py file under the source folders over `limit`."""
    found = []
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            count = line_count(path)
            if count > limit:
                found.append((path.relative_to(root).as_posix(), count))
    return found


def test_the_source_folders_are_there():
    # a moved folder would otherwise make the size check pass by checking nothing
    for folder in SOURCE_DIRS:
        assert any((ROOT / folder).rglob("*.py")), f"no .py files under {folder}/"


def test_no_source_module_exceeds_the_line_limit():
    offenders = oversized(ROOT)
    assert not offenders, f"modules over {MAX_LINES} lines (split them): " + ", ".join(
        f"{path} ({count})" for path, count in offenders
    )


def test_the_check_names_each_offender_and_its_count(tmp_path):
    (tmp_path / "reward_models" / "sub").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "reward_models" / "sub" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "scripts" / "at_limit.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "scripts" / "notes.txt").write_text("x\n" * (MAX_LINES + 5))  # not Python
    assert oversized(tmp_path) == [("reward_models/sub/big.py", MAX_LINES + 1)]


@pytest.mark.parametrize("text, lines", [("", 0), ("a\n", 1), ("a\nb", 2), ("a\n\n", 2)])
def test_line_count_counts_a_last_line_without_newline_too(tmp_path, text, lines):
    path = tmp_path / "m.py"
    path.write_text(text)
    assert line_count(path) == lines

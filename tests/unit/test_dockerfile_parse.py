"""Reading Dockerfiles (no server): stages, substitution, key=value pairs, COPY arguments, .dockerignore."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.images.dockerfile import BuildContext, Instruction, key_values, parse_copy, parse_dockerfile, substitute
from corral.sdk import InvalidRequest, NotFound


def test_substitution_follows_docker() -> None:
    names = {"A": "1", "EMPTY": ""}
    assert substitute("$A ${A} ${A:-x} ${EMPTY:-x} ${A:+y} ${EMPTY:+y} $NONE \\$A", names) == "1 1 1 x y   $A"


def test_stages_targets_and_dependencies() -> None:
    dockerfile = parse_dockerfile(
        "ARG V=1\nFROM busybox AS deps\nRUN true\nFROM busybox AS unused\nFROM scratch AS app\n"
        'COPY --from=deps /a /a\n# a comment\nCMD ["/a"]\n'
    )
    assert [stage.name for stage in dockerfile.stages] == ["deps", "unused", "app"]
    assert [stage.name for stage in dockerfile.needed(None)] == ["deps", "app"]
    assert [stage.name for stage in dockerfile.needed("unused")] == ["unused"]
    assert dockerfile.stages[2].body[1].line == 8
    with pytest.raises(InvalidRequest, match="target stage 'nope'"):
        dockerfile.needed("nope")
    with pytest.raises(InvalidRequest, match="line 1: RUN true: only ARG"):
        parse_dockerfile("RUN true\nFROM busybox\n")


def test_key_values_and_copy_arguments() -> None:
    env = Instruction(line=3, keyword="ENV", value="", text="ENV ...")
    assert key_values(env, 'A=1 B="two words" C=') == {"A": "1", "B": "two words", "C": ""}
    assert key_values(env, "OLD style value") == {"OLD": "style value"}
    copy = Instruction(line=4, keyword="COPY", value='--from=build --chown=1:2 ["a b", "c", "/dest/"]', text="COPY")
    args = parse_copy(copy)
    assert (args.sources, args.dest, args.from_stage, args.chown) == (("a b", "c"), "/dest/", "build", "1:2")
    add = Instruction(line=5, keyword="ADD", value="--from=x a b", text="ADD --from=x a b")
    with pytest.raises(InvalidRequest, match="line 5: ADD --from=x a b: ADD --from is not supported"):
        parse_copy(add)


def test_context_globs_and_dockerignore(tmp_path: Path) -> None:
    for name in ["a.txt", "b.txt", "sub/c.txt", "sub/skip.log", "keep.log", "node_modules/x.js"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / ".dockerignore").write_text("# comment\n**/*.log\n!keep.log\nnode_modules\n")
    context = BuildContext(tmp_path)
    copy = Instruction(line=2, keyword="COPY", value="", text="COPY")
    assert [p.name for p in context.sources(copy, ("*.txt",))] == ["a.txt", "b.txt"]
    walked = [str(p.relative_to(tmp_path)) for p in context.walk(tmp_path)]
    assert "sub/c.txt" in walked and "keep.log" in walked
    assert "sub/skip.log" not in walked and "node_modules/x.js" not in walked
    with pytest.raises(NotFound, match="'node_modules' matches nothing"):
        context.sources(copy, ("node_modules",))
    with pytest.raises(InvalidRequest, match="outside the build context"):
        context.sources(copy, ("../etc/passwd",))
    (tmp_path / "etc-link").symlink_to("/etc")
    with pytest.raises(InvalidRequest, match="leads outside the build context"):
        context.sources(copy, ("etc-link/hostname",))
    assert context.sources(copy, ("etc-link",)) == [tmp_path / "etc-link"]  # copied as the symlink it is


def test_escape_directive_backtick() -> None:
    dockerfile = parse_dockerfile(
        "# syntax=docker/dockerfile:1\n# escape=`\nFROM busybox\n"
        'ENV WINPATH=C:\\Tools\\bin PRICE=`$5 QUOTED="say `"hi`""\n'
        "RUN echo one\\\n"  # a backslash ends no line now: this RUN is one line
        "RUN echo two `\n  three\n"
    )
    env, run_one, run_two = dockerfile.stages[0].body
    assert env.escape == "`" and run_one.value == "echo one\\" and run_two.value == "echo two   three"
    assert run_two.text == "RUN echo two three" and run_two.line == 6
    assert key_values(env, substitute(env.value, {}, env.escape)) == {
        "WINPATH": "C:\\Tools\\bin", "PRICE": "$5", "QUOTED": 'say "hi"'
    }  # fmt: skip
    assert substitute("`$A $A \\$A", {"A": "1"}, "`") == "$A 1 \\1"
    default = parse_dockerfile("FROM busybox\nENV P=C:\\Tools\nRUN echo a \\\n  b\n# escape=`\n")
    assert default.stages[0].body[0].escape == "\\" and default.stages[0].body[1].value == "echo a   b"
    assert key_values(default.stages[0].body[0], "P=C:\\Tools") == {"P": "C:Tools"}  # the backslash escapes
    late = parse_dockerfile("FROM busybox\n# escape=`\nRUN echo a `\n")  # a directive after a line is a comment
    assert late.stages[0].body[0].escape == "\\" and late.stages[0].body[0].value == "echo a `"
    with pytest.raises(InvalidRequest, match="line 1: # escape=x: the escape directive takes"):
        parse_dockerfile("# escape=x\nFROM busybox\n")

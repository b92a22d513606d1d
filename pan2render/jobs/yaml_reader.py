"""Reading a batch's own files: bounded text reads, and YAML that keeps the line of every value.

YAML is read with ``yaml.SafeLoader`` only, bounded in nesting and in alias expansion (``LIMITS``);
we compose the node tree ourselves so every value keeps the line it was written on (:class:`Node`).
A problem (a syntax error, a control character, a tag, a key given twice, a file too large) is
noted with its line in the caller's list of problems, never raised, so that every problem of a
batch is reported at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pan2render.jobs.inputs import LIMITS, InputFileError, control_chars, describe_char, read_regular_file
from pan2render.jobs.spec import Problem, SourceLocation


@dataclass
class Node:
    """A YAML value with its 1-based line: a scalar, ``dict[str, Node]`` or ``list[Node]``.

    For a mapping value the line is its key's line (where ``frames: 20`` is written); for a list
    item it is the item's first line.
    """

    value: Any
    line: int

    def __repr__(self) -> str:  # messages show what the user wrote, not our wrapper
        return repr(self.value)


# Tags the safe loader resolves by itself; anything else (``!!python/...``, ``!custom``) is refused.
_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


class TooDeep(yaml.MarkedYAMLError):
    """Lists and mappings nested past LIMITS.nesting (the composer recurses once per level)."""


class BoundedLoader(yaml.SafeLoader):
    """The safe loader with a bound on nesting: thousands of ``[`` would otherwise end in a
    RecursionError, with no line to show."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > LIMITS.nesting:
                raise TooDeep(problem=too_deep(), problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _scalar(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """A node's value; one Python cannot hold (an integer of more digits than it converts) is a
    problem at its line, not a crash."""
    try:
        return loader.construct_object(node, deep=True)
    except ValueError as exc:
        if isinstance(exc, yaml.YAMLError):
            raise
        raise yaml.constructor.ConstructorError(None, None, unreadable_number(exc), node.start_mark) from None


def unreadable_number(exc: ValueError) -> str:
    return f"this value cannot be read as a number ({str(exc).split(';')[0]})"


class YamlReader:
    """Composes one YAML document with SafeLoader and converts it to ``Node``s, noting problems."""

    def __init__(self, display: str, problems: list[Problem]):
        self.display = display
        self.problems = problems

    def read(self, text: str) -> Node | None:
        if self._control_chars(text):
            return None
        loader = BoundedLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                return None
            if not self._expansion_ok(root):
                return None
            return self._convert(loader, root, root.start_mark.line + 1, {}, set())
        except TooDeep as exc:
            line = exc.problem_mark.line + 1 if exc.problem_mark is not None else 1
            self._problem(line, "(yaml)", str(exc.problem))
            return None
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            what = " ".join(str(s) for s in (exc.context, exc.problem) if s)
            if isinstance(exc, yaml.constructor.ConstructorError):  # e.g. a !!python tag
                self._problem(line, "(yaml)", f"{what}; use plain YAML values (strings, numbers, lists, mappings)")
            else:
                self._problem(line, "(yaml)", f"YAML syntax error: {what}; fix the file at this line")
            return None
        except yaml.YAMLError as exc:
            self._problem(1, "(yaml)", f"YAML error: {exc}")
            return None
        finally:
            loader.dispose()

    def _problem(self, line: int, fld: str, message: str) -> None:
        self.problems.append(Problem(SourceLocation(self.display, line), fld, message))

    def _control_chars(self, text: str) -> bool:
        """Note each line holding a NUL or another control character (tab and line ends pass)."""
        found = False
        for lineno, line in enumerate(text.split("\n"), start=1):
            bad = control_chars(line, newlines=True)
            if bad:
                col, char = bad[0]
                self._problem(lineno, "(yaml)", f"control character {describe_char(char)} at column {col + 1}; "
                                                "allowed: printable text (write it as a YAML escape if you must)")
                found = True
        return found

    def _expansion_ok(self, root: yaml.Node) -> bool:
        """Refuse documents whose aliases expand past the limits ("billion laughs"), before anything
        is built from them: expanded sizes are counted once per node, so this is linear in the text."""
        size: dict[int, int] = {}
        aliases = 0
        stack: list[tuple[yaml.Node, bool]] = [(root, False)]
        while stack:
            node, children_done = stack.pop()
            if id(node) in size and not children_done:
                aliases += 1
                if aliases > LIMITS.yaml_aliases:
                    self._problem(node.start_mark.line + 1, "(yaml)",
                                  f"more than {LIMITS.yaml_aliases} alias references (*name); allowed: at most "
                                  f"{LIMITS.yaml_aliases} in one batch")
                    return False
                continue
            if isinstance(node, yaml.ScalarNode):
                size[id(node)] = 1
                continue
            children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                        else list(node.value))
            if not children_done:
                size[id(node)] = 0  # visited: a later reference is an alias (or a recursion)
                stack.append((node, True))
                stack.extend((c, False) for c in reversed(children))
                continue
            size[id(node)] = 1 + sum(size[id(c)] for c in children)
            if size[id(node)] > LIMITS.yaml_values:
                self._problem(node.start_mark.line + 1, "(yaml)",
                              f"the value written here expands through aliases to more than {LIMITS.yaml_values:,} "
                              f"values; allowed: at most {LIMITS.yaml_values:,} after alias expansion")
                return False
        return True

    def _convert(self, loader: yaml.SafeLoader, node: yaml.Node, line: int, memo: dict[int, Any],
                 active: set[int]) -> Node:
        # Aliases share node objects: memoising keeps "billion laughs" documents linear, and the
        # active set catches an alias that points into its own anchor.
        if id(node) in active:
            raise yaml.constructor.ConstructorError(None, None, "recursive alias", node.start_mark)
        if not isinstance(node, yaml.ScalarNode) and node.tag not in _COLLECTION_TAGS:
            raise yaml.constructor.ConstructorError(
                None, None, f"tag {node.tag!r} is not allowed (plain YAML only)", node.start_mark)
        if isinstance(node, yaml.MappingNode):
            if id(node) not in memo:
                active.add(id(node))
                memo[id(node)] = self._mapping(loader, node, memo, active)
                active.discard(id(node))
            return Node(memo[id(node)], line)
        if isinstance(node, yaml.SequenceNode):
            if id(node) not in memo:
                active.add(id(node))
                memo[id(node)] = [self._convert(loader, item, item.start_mark.line + 1, memo, active)
                                  for item in node.value]
                active.discard(id(node))
            return Node(memo[id(node)], line)
        return Node(_scalar(loader, node), line)

    def _mapping(self, loader: yaml.SafeLoader, node: yaml.MappingNode, memo: dict[int, Any],
                 active: set[int]) -> dict[str, Node]:
        own: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = _scalar(loader, key_node)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in own:
                self._problem(line, key, f"key {key!r} appears twice (first on line {own[key]}); keep one")
            own.setdefault(key, line)
        loader.flatten_mapping(node)  # resolves `<<: *anchor` merges; own keys come last and win
        out: dict[str, Node] = {}
        for key_node, value_node in node.value:
            key = _scalar(loader, key_node)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                self._problem(line, str(key), f"keys must be strings, got {key!r} ({type(key).__name__}); quote it")
                continue
            out[key] = self._convert(loader, value_node, line, memo, active)
        return out


def read_text(path: Path, display: str, problems: list[Problem], *, what: str, limit: int,
              location: SourceLocation | None = None, fld: str = "(file)") -> str | None:
    """A file the batch reads (itself, a preset file, a prompts file) as UTF-8 text of at most
    ``limit`` bytes; None with the problem noted at ``location`` (line 1 of ``display``) if not."""
    where = location or SourceLocation(display, 1)
    try:
        return read_regular_file(path, limit=limit).decode("utf-8")
    except InputFileError as exc:
        problems.append(Problem(where, fld, f"{what} {str(path)!r} {exc}"))
    except FileNotFoundError:
        problems.append(Problem(where, fld, f"{what} {str(path)!r} does not exist"))
    except IsADirectoryError:
        problems.append(Problem(where, fld, f"{what} {str(path)!r} is a folder, not a file"))
    except UnicodeDecodeError as exc:
        problems.append(Problem(where, fld, f"{what} {str(path)!r} is not UTF-8 text "
                                            f"({exc.reason} at byte {exc.start})"))
    except OSError as exc:
        problems.append(Problem(where, fld, f"cannot read {what} {str(path)!r}: {exc.strerror}"))
    return None


def too_deep() -> str:
    """The problem of a value nested past LIMITS.nesting (YAML, a JSON row or a flag)."""
    return (f"values nested more than {LIMITS.nesting} levels deep; allowed: at most {LIMITS.nesting} levels of "
            "lists and mappings inside one another")

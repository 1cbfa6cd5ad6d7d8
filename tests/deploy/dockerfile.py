"""A Dockerfile read into its instructions, enough for the checks in tests/deploy.

    Dockerfile(path).instructions -> [Instruction("RUN", "pip install ...", line), ...]

Continuation lines are joined, comments dropped; ENV and ARG are parsed into dicts (the KEY=VALUE
form the images use). Not a full parser: heredocs and parser directives are not handled, and a
Dockerfile that uses them fails `Dockerfile.__init__` loudly rather than being misread.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the instruction, continuations joined with a space
    line: int  # 1-based line where it starts


def _pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for word in shlex.split(text):
        if "=" not in word:
            raise ValueError(f"only KEY=VALUE is supported here: {text!r}")
        key, value = word.split("=", 1)
        out[key] = value
    return out


class Dockerfile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.instructions: list[Instruction] = []
        pending: list[str] = []
        start = 0
        for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = raw.strip()
            if not pending and (not line or line.startswith("#")):
                continue
            if pending and line.startswith("#"):
                continue  # a comment inside a continued instruction
            if "<<" in line and line.split()[0].upper() in ("RUN", "COPY"):
                raise ValueError(f"{path}:{number}: heredocs are not handled")
            if not pending:
                start = number
            if line.endswith("\\"):
                pending.append(line[:-1].strip())
                continue
            pending.append(line)
            text = " ".join(p for p in pending if p)
            keyword, _, args = text.partition(" ")
            self.instructions.append(Instruction(keyword.upper(), args.strip(), start))
            pending = []
        if pending:
            raise ValueError(f"{path}: ends inside a continued instruction")
        # Stages: FROM <image or earlier stage> [AS name]. The shipped image is the last stage
        # and the stages it is FROM, back to a base; a build stage beside them is not in it.
        self.stages: dict[str, list[Instruction]] = {}
        parents: dict[str, str | None] = {}
        current = ""
        for inst in self.instructions:
            if inst.keyword == "FROM":
                words = inst.args.split()
                current = words[2] if len(words) == 3 and words[1].upper() == "AS" \
                    else f"#{len(self.stages)}"
                parents[current] = words[0] if words[0] in self.stages else None
                self.stages[current] = []
            if current:
                self.stages[current].append(inst)
        lineage: list[str] = []
        stage: str | None = current or None
        while stage is not None:
            lineage.insert(0, stage)
            stage = parents[stage]
        self.image = [i for name in lineage for i in self.stages[name]] if lineage \
            else list(self.instructions)

    def all(self, keyword: str) -> list[Instruction]:
        """The instructions of this keyword that build the shipped image (build stages beside
        it left out)."""
        return [i for i in self.image if i.keyword == keyword]

    def stage(self, name: str) -> list[Instruction]:
        return self.stages[name]

    def env(self) -> dict[str, str]:
        """Every ENV of the (single-stage) image, later ones winning."""
        out: dict[str, str] = {}
        for inst in self.all("ENV"):
            out.update(_pairs(inst.args))
        return out

    def args(self) -> dict[str, str]:
        """ARG defaults (an ARG without a default maps to '')."""
        out: dict[str, str] = {}
        for inst in self.instructions:  # those before the first FROM too
            if inst.keyword != "ARG":
                continue
            name, _, default = inst.args.partition("=")
            out[name.strip()] = shlex.split(default)[0] if default else ""
        return out

    def exec_form(self, keyword: str) -> list[str]:
        """The JSON (exec) form of the last CMD/ENTRYPOINT, or of HEALTHCHECK's CMD."""
        inst = self.all(keyword)[-1]
        text = inst.args
        if keyword == "HEALTHCHECK":
            text = text[text.index("CMD ") + len("CMD "):]
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value)
        return value

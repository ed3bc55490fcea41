"""Lean's names for what an index holds, as `leanagent serve` answers them (no server: pure functions)."""

from __future__ import annotations

import pytest

from leanagent.serve import lean_name, module_name


@pytest.mark.parametrize(("name", "written"), [
    ("Nat.add_comm", "Nat.add_comm"),
    ("Finset.sum_α₁", "Finset.sum_α₁"),
    ("Foo.bar'", "Foo.bar'"),
    ("_private.Mathlib.Logic.0.foo", "_private.Mathlib.Logic.«0».foo"),
    ("Foo.«term_+_».bar", "Foo.«term_+_».bar"),
    ("Foo.a b", "Foo.«a b»"),
])
def test_names_are_written_as_lean_reads_them(name: str, written: str) -> None:
    assert lean_name(name) == written


@pytest.mark.parametrize(("path", "module"), [
    ("RepoA/Base.lean", "RepoA.Base"),
    (".lake/packages/mathlib/Mathlib/Algebra/Group/Defs.lean", "Mathlib.Algebra.Group.Defs"),
    (".lake/packages/lean4/src/lean/Init/Prelude.lean", "Init.Prelude"),
    (".lake/packages/lean4/src/lean/lake/Lake/Build.lean", "Lake.Build"),
    ("./Lean4Example.lean", "Lean4Example"),
])
def test_module_names_of_corpus_paths(path: str, module: str) -> None:
    assert module_name(path) == module

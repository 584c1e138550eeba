"""The DP core header is plain C++17: it compiles warning-free on its own (no Python) and solves a known instance."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CPP = Path(__file__).resolve().parents[1] / "cpp"
COMPILER = shutil.which("g++") or shutil.which("clang++")

PROGRAM = r"""
#include <cstdio>
#include "stage_dp.hpp"

int main() {
  using namespace galva::dp;
  // 3 layers x 2 strategies: 0 = fast and big, 1 = slow and small; switching costs 0.5.
  StageProblem p;
  p.layers = 3;
  p.strategies = 2;
  p.intra = {1, 3, 1, 3, 1, 3};
  p.memory = {4, 1, 4, 1, 4, 1};
  p.inter = {0, 0, 0, 0, 0, 0.5, 0.5, 0, 0, 0.5, 0.5, 0};
  p.budget = 9;  // room for two fast layers: best is 0,0,1 (or 1,0,0): 1 + 1 + 0.5 + 3 = 5.5
  Stats st;
  StageSolution s = solve(p, Options(), &st);
  std::printf("%d %.3f %.3f %s\n", s.feasible ? 1 : 0, s.time, s.memory, st.method.c_str());
  std::vector<StageProblem> many(5, p);
  many[2].budget = 2;  // infeasible
  std::vector<StageSolution> r = solve_many(many, Options(), 3);
  std::printf("%d %d\n", r[0].feasible ? 1 : 0, r[2].feasible ? 1 : 0);
  try {
    p.intra[4] = -1;
    solve(p);
  } catch (const std::invalid_argument& e) {
    std::printf("%s\n", e.what());
  }
  return 0;
}
"""


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
def test_header_compiles_without_warnings_and_solves(tmp_path: Path) -> None:
    src = tmp_path / "main.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "main"
    cmd = [COMPILER, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-pthread",
           f"-I{CPP}", str(src), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()
    feasible, time, memory, _method = out[0].split()
    assert (feasible, float(time), float(memory)) == ("1", 5.5, 9.0)
    assert out[1] == "1 0"
    assert out[2].startswith("intra_time[2][0] = -1: ") and "negative" in out[2]

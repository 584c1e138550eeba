"""megatron-core is imported without torch's compiler, and torch.compile is left as it was."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, warnings
import torch
compile_ = torch.compile
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from galva_hp.megatron_import import import_megatron
    tensor_parallel = import_megatron("megatron.core.tensor_parallel")
    indexed = import_megatron("megatron.core.datasets.indexed_dataset")
import megatron.core.jit as jit
print(hasattr(tensor_parallel, "ColumnParallelLinear"), hasattr(indexed, "IndexedDataset"),
      "torch._inductor.compile_fx" in sys.modules, torch.compile is compile_,
      jit.jit_fuser(len) is len, any("Transformer Engine and Apex" in str(w.message) for w in caught))
"""


def test_megatron_core_imports_without_torch_s_compiler_in_a_fresh_process() -> None:
    """In a process that had not imported megatron-core: its modules import, torch's inductor is not imported (the
    fused kernels megatron wraps at import stay plain functions), torch.compile is restored afterwards and
    megatron's fallback note is not printed."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "True", "False", "True", "True", "False"], out.stdout + out.stderr

"""The shape of a cluster: nodes, devices per node, device memory."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from galva_schema._base import GalvaFile


class ClusterSpec(GalvaFile):
    """Nodes of identical devices. Ranks are numbered node-major: rank = node * gpus_per_node + local rank."""

    kind: Literal["galva.cluster"] = "galva.cluster"
    num_nodes: PositiveInt = 1
    gpus_per_node: PositiveInt = Field(description="Devices (GPUs, or CPU processes) per node.")
    device_memory_mib: PositiveFloat | None = Field(None, description="Physical memory of one device, MiB.")
    device_name: str | None = Field(None, description="For example 'NVIDIA H100 80GB HBM3' or 'cpu'.")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

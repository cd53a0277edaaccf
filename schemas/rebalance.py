"""Rebalance directives: the tracker asks a node to load a different Shard."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from schemas.base import BusMessage


class RebalanceDirective(BusMessage):
    """Published on mesh.tracker.rebalance.<node_id>: "load layers [layer_start, layer_end) of model"."""

    TYPE: ClassVar[str] = "tracker.rebalance"
    node_id: str
    model: str  # model name as announced
    model_revision: str | None = None
    n_layer: int | None = None
    layer_start: int = Field(ge=0)
    layer_end: int = Field(gt=0)
    reason: str
    artifact_id: str | None = None
    issued_by: str = ""  # the tracker that ordered it (trackers in a group skip what another ordered)  # fetch the range's pieces of this artifact (a spare holds no file)

    @model_validator(mode="after")
    def _check(self) -> RebalanceDirective:
        if self.layer_start >= self.layer_end:
            raise ValueError(f"empty layer range [{self.layer_start}, {self.layer_end})")
        if self.n_layer is not None and self.layer_end > self.n_layer:
            raise ValueError(f"layer_end {self.layer_end} > n_layer {self.n_layer}")
        return self

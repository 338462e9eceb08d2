"""The run's token windows as the nodes fetch them (the Windows RPC), and validation losses as bits per byte."""

from __future__ import annotations

from geotrain.config import RunConfig
from geotrain.dataset import PreparedDataset, bits_per_byte
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.errors import ReportRefused


class TokenWindows:
    """Serves a microbatch's windows of the prepared data set; a run on the byte corpus serves none (every node reads
    it itself)."""

    def __init__(self, cfg: RunConfig) -> None:
        self._cfg = cfg
        self.dataset = PreparedDataset.open(cfg.data.prepared) if cfg.data.prepared else None

    def serve(self, request: pb.WindowsRequest) -> pb.WindowsReply:
        """A microbatch's windows (the caller checked that the request is a live member's); ReportRefused for a run
        on the byte corpus, or a step or microbatch the run never issues."""
        cfg = self._cfg
        if self.dataset is None:
            raise ReportRefused("this run trains on the byte corpus, which every node reads itself")
        count = cfg.run.eval_microbatches if request.validation else cfg.train.microbatches
        if request.step >= cfg.run.steps or request.microbatch >= count:
            raise ReportRefused(
                f"windows refused: step {request.step} microbatch {request.microbatch} is not one of the run's "
                f"{cfg.run.steps} steps of {count} {'validation ' if request.validation else ''}microbatches"
            )
        windows = self.dataset.windows(
            seed=cfg.run.seed, step=request.step, microbatch=request.microbatch, size=cfg.train.microbatch_size,
            seq_len=cfg.model.seq_len, validation=request.validation,
        )
        return pb.WindowsReply(
            fingerprint=self.dataset.fingerprint, rows=windows.shape[0], cols=windows.shape[1],
            tokens=windows.astype("<u4").tobytes(),
        )

    def bits_per_byte(self, loss: float) -> float:
        """A validation loss (nats per token) as bits per byte of the validation text."""
        if self.dataset is not None:
            return self.dataset.bits_per_byte(loss)
        return bits_per_byte(loss, 1, 1)  # the byte corpus: one token a byte

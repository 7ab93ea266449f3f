"""Typed errors a user can cause. Each message names the file, tensor or field and what was expected."""


class DeltaflashError(Exception):
    """Base class of every error deltaflash raises on purpose."""


class CheckpointError(DeltaflashError):
    """A checkpoint folder cannot be loaded."""


class UnsupportedModelError(CheckpointError):
    """config.json names a model type deltaflash does not serve."""


class UnknownLayerTypeError(CheckpointError):
    """config.json lists a layer type other than linear_attention / full_attention."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is in no safetensors file of the checkpoint."""


class TensorShapeError(CheckpointError):
    """A tensor has another shape than the config implies."""


class DrafterMismatchError(CheckpointError):
    """A drafter checkpoint does not fit the target it is paired with."""


class SlotsExhaustedError(DeltaflashError):
    """Every slot of the pool holds a live sequence."""


class PagesExhaustedError(DeltaflashError):
    """The page pool has too few free pages for what was asked (the scheduler preempts before it asks)."""


class CommitRejectedError(DeltaflashError):
    """A commit transaction failed validation; nothing was changed."""


class RequestError(DeltaflashError, ValueError):
    """A generation request is invalid (bad sampling parameters, prompt too long, ...)."""

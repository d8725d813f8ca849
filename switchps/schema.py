"""What every config section shares: the strict base class and the bounds on numbers."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys and inf/NaN are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


MAX_WORKERS = 1024
"""Each worker is a process and two PS server threads; protobuf counts workers in int32."""
MAX_BATCH = 2**20
"""Samples per step: one step's micro-batches are NumPy arrays built at once."""
MAX_STEPS = 2**31 - 1
"""Model versions and schedule steps: far beyond any run, and within every int32/int64 on the wire."""
MAX_SEED = 2**32 - 1
"""NumPy's legacy seeding (used by keras.utils.set_random_seed) takes [0, 2**32 - 1]."""
MAX_THREADS = 256
"""TensorFlow op threads per process."""

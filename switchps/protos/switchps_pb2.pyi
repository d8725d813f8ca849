from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Variable(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("variables", "digest", "state", "wire_dtype")
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedCompositeFieldContainer[Variable]
    digest: str
    state: _containers.RepeatedCompositeFieldContainer[Variable]
    wire_dtype: str
    def __init__(self, variables: _Optional[_Iterable[_Union[Variable, _Mapping]]] = ..., digest: _Optional[str] = ..., state: _Optional[_Iterable[_Union[Variable, _Mapping]]] = ..., wire_dtype: _Optional[str] = ...) -> None: ...

class WorkOrder(_message.Message):
    __slots__ = ("protocol", "version", "sample_budget", "time_budget_s", "micro_batch", "stop", "pipeline", "local")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    version: int
    sample_budget: int
    time_budget_s: float
    micro_batch: int
    stop: bool
    pipeline: bool
    local: LocalSteps
    def __init__(self, protocol: _Optional[str] = ..., version: _Optional[int] = ..., sample_budget: _Optional[int] = ..., time_budget_s: _Optional[float] = ..., micro_batch: _Optional[int] = ..., stop: _Optional[bool] = ..., pipeline: _Optional[bool] = ..., local: _Optional[_Union[LocalSteps, _Mapping]] = ...) -> None: ...

class LocalSteps(_message.Message):
    __slots__ = ("steps", "batch", "inner_optimizer", "reset_inner_state")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    INNER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    RESET_INNER_STATE_FIELD_NUMBER: _ClassVar[int]
    steps: int
    batch: int
    inner_optimizer: str
    reset_inner_state: bool
    def __init__(self, steps: _Optional[int] = ..., batch: _Optional[int] = ..., inner_optimizer: _Optional[str] = ..., reset_inner_state: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "layout", "partition_size", "shard_partition", "framework", "device", "local_steps", "session")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PARTITION_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARD_PARTITION_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    layout: Layout
    partition_size: int
    shard_partition: str
    framework: str
    device: str
    local_steps: bool
    session: int
    def __init__(self, worker: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., partition_size: _Optional[int] = ..., shard_partition: _Optional[str] = ..., framework: _Optional[str] = ..., device: _Optional[str] = ..., local_steps: _Optional[bool] = ..., session: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("send_init", "order", "num_workers")
    SEND_INIT_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    send_init: bool
    order: WorkOrder
    num_workers: int
    def __init__(self, send_init: _Optional[bool] = ..., order: _Optional[_Union[WorkOrder, _Mapping]] = ..., num_workers: _Optional[int] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("step", "compute_s", "send_s", "wait_s", "sleep_s", "loss_sum", "delay_sleep_s", "delay_factor", "delay_comm_s", "batch_exhausted", "overlapped", "local_steps", "local_loss_sums")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SEND_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SLEEP_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    DELAY_SLEEP_S_FIELD_NUMBER: _ClassVar[int]
    DELAY_FACTOR_FIELD_NUMBER: _ClassVar[int]
    DELAY_COMM_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LOSS_SUMS_FIELD_NUMBER: _ClassVar[int]
    step: int
    compute_s: float
    send_s: float
    wait_s: float
    sleep_s: float
    loss_sum: float
    delay_sleep_s: float
    delay_factor: float
    delay_comm_s: float
    batch_exhausted: bool
    overlapped: bool
    local_steps: int
    local_loss_sums: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step: _Optional[int] = ..., compute_s: _Optional[float] = ..., send_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., sleep_s: _Optional[float] = ..., loss_sum: _Optional[float] = ..., delay_sleep_s: _Optional[float] = ..., delay_factor: _Optional[float] = ..., delay_comm_s: _Optional[float] = ..., batch_exhausted: _Optional[bool] = ..., overlapped: _Optional[bool] = ..., local_steps: _Optional[int] = ..., local_loss_sums: _Optional[_Iterable[float]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker", "base_version", "samples", "layout_digest", "nbytes", "stats", "session", "attempt", "shared")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    worker: int
    base_version: int
    samples: int
    layout_digest: str
    nbytes: int
    stats: StepStats
    session: int
    attempt: int
    shared: bool
    def __init__(self, worker: _Optional[int] = ..., base_version: _Optional[int] = ..., samples: _Optional[int] = ..., layout_digest: _Optional[str] = ..., nbytes: _Optional[int] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ..., session: _Optional[int] = ..., attempt: _Optional[int] = ..., shared: _Optional[bool] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("order", "applied", "note", "staleness", "wait_s", "nbytes", "shared")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    order: WorkOrder
    applied: bool
    note: str
    staleness: int
    wait_s: float
    nbytes: int
    shared: bool
    def __init__(self, order: _Optional[_Union[WorkOrder, _Mapping]] = ..., applied: _Optional[bool] = ..., note: _Optional[str] = ..., staleness: _Optional[int] = ..., wait_s: _Optional[float] = ..., nbytes: _Optional[int] = ..., shared: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("worker", "name", "nonce", "nbytes")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    worker: int
    name: str
    nonce: bytes
    nbytes: int
    def __init__(self, worker: _Optional[int] = ..., name: _Optional[str] = ..., nonce: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("attached", "note", "socket")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    attached: bool
    note: str
    socket: str
    def __init__(self, attached: _Optional[bool] = ..., note: _Optional[str] = ..., socket: _Optional[str] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("order", "nbytes")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    order: WorkOrder
    nbytes: int
    def __init__(self, order: _Optional[_Union[WorkOrder, _Mapping]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("order",)
    ORDER_FIELD_NUMBER: _ClassVar[int]
    order: WorkOrder
    def __init__(self, order: _Optional[_Union[WorkOrder, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker", "have_version", "wait_initialized", "master")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    worker: int
    have_version: int
    wait_initialized: bool
    master: bool
    def __init__(self, worker: _Optional[int] = ..., have_version: _Optional[int] = ..., wait_initialized: _Optional[bool] = ..., master: _Optional[bool] = ...) -> None: ...

class InitHeader(_message.Message):
    __slots__ = ("worker", "layout_digest", "nbytes")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    worker: int
    layout_digest: str
    nbytes: int
    def __init__(self, worker: _Optional[int] = ..., layout_digest: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class EvalReport(_message.Message):
    __slots__ = ("version", "test_loss", "test_accuracy", "final")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    test_loss: float
    test_accuracy: float
    final: bool
    def __init__(self, version: _Optional[int] = ..., test_loss: _Optional[float] = ..., test_accuracy: _Optional[float] = ..., final: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker", "session")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    session: int
    def __init__(self, worker: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Status(_message.Message):
    __slots__ = ("version", "protocol", "test_accuracy", "done", "final_eval_done", "samples", "total_steps", "progress", "active_workers", "members", "paused")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FINAL_EVAL_DONE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    version: int
    protocol: str
    test_accuracy: float
    done: bool
    final_eval_done: bool
    samples: int
    total_steps: int
    progress: float
    active_workers: int
    members: int
    paused: bool
    def __init__(self, version: _Optional[int] = ..., protocol: _Optional[str] = ..., test_accuracy: _Optional[float] = ..., done: _Optional[bool] = ..., final_eval_done: _Optional[bool] = ..., samples: _Optional[int] = ..., total_steps: _Optional[int] = ..., progress: _Optional[float] = ..., active_workers: _Optional[int] = ..., members: _Optional[int] = ..., paused: _Optional[bool] = ...) -> None: ...

class PartKey(_message.Message):
    __slots__ = ("worker", "session", "step", "attempt")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    worker: int
    session: int
    step: int
    attempt: int
    def __init__(self, worker: _Optional[int] = ..., session: _Optional[int] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class PartHeader(_message.Message):
    __slots__ = ("key", "layout_digest", "nbytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    key: PartKey
    layout_digest: str
    nbytes: int
    def __init__(self, key: _Optional[_Union[PartKey, _Mapping]] = ..., layout_digest: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PartReply(_message.Message):
    __slots__ = ("version", "nbytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    nbytes: int
    def __init__(self, version: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PartPull(_message.Message):
    __slots__ = ("worker", "min_version", "master")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    worker: int
    min_version: int
    master: bool
    def __init__(self, worker: _Optional[int] = ..., min_version: _Optional[int] = ..., master: _Optional[bool] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("key", "reason", "message", "squares")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SQUARES_FIELD_NUMBER: _ClassVar[int]
    key: PartKey
    reason: str
    message: str
    squares: float
    def __init__(self, key: _Optional[_Union[PartKey, _Mapping]] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., squares: _Optional[float] = ...) -> None: ...

class ShardSaved(_message.Message):
    __slots__ = ("version", "digest", "error")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    version: int
    digest: str
    error: str
    def __init__(self, version: _Optional[int] = ..., digest: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class FollowerMessage(_message.Message):
    __slots__ = ("hello", "verdict", "saved", "restored")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    hello: int
    verdict: Verdict
    saved: ShardSaved
    restored: ShardSaved
    def __init__(self, hello: _Optional[int] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., saved: _Optional[_Union[ShardSaved, _Mapping]] = ..., restored: _Optional[_Union[ShardSaved, _Mapping]] = ...) -> None: ...

class JoinPart(_message.Message):
    __slots__ = ("key", "aggregate", "push")
    KEY_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    key: PartKey
    aggregate: int
    push: int
    def __init__(self, key: _Optional[_Union[PartKey, _Mapping]] = ..., aggregate: _Optional[int] = ..., push: _Optional[int] = ...) -> None: ...

class FreePart(_message.Message):
    __slots__ = ("key", "push")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    key: PartKey
    push: int
    def __init__(self, key: _Optional[_Union[PartKey, _Mapping]] = ..., push: _Optional[int] = ...) -> None: ...

class PushInfo(_message.Message):
    __slots__ = ("id", "worker", "base_version", "samples", "loss_sum", "arrived", "staleness", "step", "session", "squares", "lag", "local_steps")
    ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SQUARES_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    id: int
    worker: int
    base_version: int
    samples: int
    loss_sum: float
    arrived: float
    staleness: int
    step: int
    session: int
    squares: float
    lag: int
    local_steps: int
    def __init__(self, id: _Optional[int] = ..., worker: _Optional[int] = ..., base_version: _Optional[int] = ..., samples: _Optional[int] = ..., loss_sum: _Optional[float] = ..., arrived: _Optional[float] = ..., staleness: _Optional[int] = ..., step: _Optional[int] = ..., session: _Optional[int] = ..., squares: _Optional[float] = ..., lag: _Optional[int] = ..., local_steps: _Optional[int] = ...) -> None: ...

class ApplyPart(_message.Message):
    __slots__ = ("aggregate", "samples", "lr_factor", "version", "started", "members", "protocol", "time_budget_s", "wait_s", "outer_optimizer", "num_workers")
    AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LR_FACTOR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    aggregate: int
    samples: int
    lr_factor: float
    version: int
    started: float
    members: _containers.RepeatedCompositeFieldContainer[PushInfo]
    protocol: str
    time_budget_s: float
    wait_s: float
    outer_optimizer: str
    num_workers: int
    def __init__(self, aggregate: _Optional[int] = ..., samples: _Optional[int] = ..., lr_factor: _Optional[float] = ..., version: _Optional[int] = ..., started: _Optional[float] = ..., members: _Optional[_Iterable[_Union[PushInfo, _Mapping]]] = ..., protocol: _Optional[str] = ..., time_budget_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., outer_optimizer: _Optional[str] = ..., num_workers: _Optional[int] = ...) -> None: ...

class PushOutcome(_message.Message):
    __slots__ = ("applied", "staleness", "wait_s", "note")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    staleness: int
    wait_s: float
    note: str
    def __init__(self, applied: _Optional[bool] = ..., staleness: _Optional[int] = ..., wait_s: _Optional[float] = ..., note: _Optional[str] = ...) -> None: ...

class ReleasePart(_message.Message):
    __slots__ = ("push", "worker", "outcome", "order")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    push: int
    worker: int
    outcome: PushOutcome
    order: WorkOrder
    def __init__(self, push: _Optional[int] = ..., worker: _Optional[int] = ..., outcome: _Optional[_Union[PushOutcome, _Mapping]] = ..., order: _Optional[_Union[WorkOrder, _Mapping]] = ...) -> None: ...

class OptimizerChange(_message.Message):
    __slots__ = ("lr_scale", "has_momentum", "momentum", "state", "state_scale")
    LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    HAS_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_SCALE_FIELD_NUMBER: _ClassVar[int]
    lr_scale: float
    has_momentum: bool
    momentum: float
    state: str
    state_scale: float
    def __init__(self, lr_scale: _Optional[float] = ..., has_momentum: _Optional[bool] = ..., momentum: _Optional[float] = ..., state: _Optional[str] = ..., state_scale: _Optional[float] = ...) -> None: ...

class DropPart(_message.Message):
    __slots__ = ("key", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: PartKey
    reason: str
    def __init__(self, key: _Optional[_Union[PartKey, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class ShardAction(_message.Message):
    __slots__ = ("setup", "initialize", "join", "free", "apply", "release", "optimizer", "drop", "stop", "checkpoint", "restore")
    SETUP_FIELD_NUMBER: _ClassVar[int]
    INITIALIZE_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    setup: Layout
    initialize: PartKey
    join: JoinPart
    free: FreePart
    apply: ApplyPart
    release: ReleasePart
    optimizer: OptimizerChange
    drop: DropPart
    stop: bool
    checkpoint: int
    restore: ShardSaved
    def __init__(self, setup: _Optional[_Union[Layout, _Mapping]] = ..., initialize: _Optional[_Union[PartKey, _Mapping]] = ..., join: _Optional[_Union[JoinPart, _Mapping]] = ..., free: _Optional[_Union[FreePart, _Mapping]] = ..., apply: _Optional[_Union[ApplyPart, _Mapping]] = ..., release: _Optional[_Union[ReleasePart, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerChange, _Mapping]] = ..., drop: _Optional[_Union[DropPart, _Mapping]] = ..., stop: _Optional[bool] = ..., checkpoint: _Optional[int] = ..., restore: _Optional[_Union[ShardSaved, _Mapping]] = ...) -> None: ...

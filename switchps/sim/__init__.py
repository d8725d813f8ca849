"""A discrete-event simulator of a whole run: the project's own core, protocols, policies, straggler code,
device and link models, on a virtual clock, with real gradients (or none: ``time_only``).

The simulator supplies only time and gradients; every rule it runs is the real system's, imported:
- ``loop``: the event heap (virtual time; ties broken by a sequence number) and a worker's virtual clock;
- ``network``: the PS's emulated link (``ps_server.link.Link``'s arithmetic) on virtual time;
- ``workers``: simulated workers, whose steps are the worker's own ``StepRunner`` on a virtual clock with
  a ``Computer`` that keeps the sample indices a step drew instead of computing (an order's local steps:
  one such step each, then one push);
- ``learner``: what a step's samples are worth: nothing (``TimeOnly``) or real losses and gradients at
  each push's base version, computed lazily, one batched call per group of pushes on one version
  (``Real``, the only module that loads TensorFlow; a push of local steps: its own inner trajectory);
- ``churn``: when an elastic run's workers depart and arrive (the ``churn`` section: a trace, or Poisson
  preemptions); the driver stops and starts them, and the core notices a departure by its own rule;
- ``driver``: the third driver of the core (after the gRPC service and the test harness): it turns
  events into core calls and executes the actions, with the store's update rule and the run record;
- ``run``: ``simulate(cfg, run_dir)``, a normal run directory written, with a progress bar.

Concurrency: single-threaded, on purpose. One thread runs the event loop, the core, the learner and the
recorder (built without its flusher thread; the driver flushes it); nothing here takes a lock or starts
a thread, and no rule reads the wall clock (only the progress bar and the summary's ``sim_wall_s`` do).
"""

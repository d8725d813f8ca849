"""The protocol core: events in, actions out, no I/O, no threads, no clock, no arrays.

Its parts, one module each, own their state and save it themselves (``state_dict``/``load_state_dict``):
- ``machine``: ``Core`` (import it from there), the event loop of the core: the version, the sample
  count, running the effects of the protocol in force; its checkpoint is its parts' states together
  (each a ``Part``). The parts return records, actions and effects; none calls back into the core;
- ``lifecycle``: membership, the start and the end of training, whether the run resumed after a crash;
- ``admission``: what each worker's work orders allow its next push to claim (``Orders``), and which
  pushes arrived, so a resent one is never applied twice (``Receipts``);
- ``outbox``: what the event in hand tells the driver (``Outbox``), and the ids it gives aggregates;
- ``switching``: the protocol in force, a switch decided, waiting for its round and made, the
  learning-rate scale and momentum and the ramp after a switch, the switch records;
- ``consulting``: the policy, when it is asked, what it sees, the batches it set.

What the parts use, none of it with state of the core's own:
- ``events`` (what flows in: pushes, step reports, aggregates, work orders) and ``actions`` (what comes
  out, the ``Executor`` every driver is, and ``execute``);
- ``protocols``, the registry of each protocol's pair of rules: a work rule (``work_rules``: what an
  order asks) and an aggregation rule (``aggregation``: which pushes form an update, and when);
- ``rescale`` (the learning-rate scale and momentum under a protocol) and ``overhead`` (what a switch
  costs, for the record).
"""

"""Where baselines live: how a recorded reference is kept, found, read, verified and written.

The modules of this package, one per question:

* ``compact`` — what of a training step's large gradient and parameter leaves a baseline keeps
  (``TrainStore``, the ``@sample`` / ``@stats`` leaves, ``apply_recorded``).

The file format, the reading, verification and writing of a file, the object pool, the store lock
and the ``baselines prune|verify`` command line are in ``pytest_npu_parity.baselines``, with the
machine facts and fingerprints in ``pytest_npu_parity.provenance`` and the module configuration in
``pytest_npu_parity.structure``. The old import path ``pytest_npu_parity.compact`` re-exports every
name of ``store.compact``. This package never imports pytest and never imports a model adapter.
"""

"""Where baselines live: how a recorded reference is kept, found, read, verified and written.

The modules of this package, one per question:

* ``format`` — the file format's constants (``FORMAT``, ``FORMAT_VERSION``, the pool's), the store's
  errors (``BaselineError`` and its kinds) and the data classes of a baseline (``CheckBaseline``,
  ``Baseline``);
* ``lock`` — ``StoreLock``, which serializes the record runs (and ``baselines prune``) of one store;
* ``compact`` — what of a training step's large gradient and parameter leaves a baseline keeps
  (``TrainStore``, the ``@sample`` / ``@stats`` leaves, ``apply_recorded``).

The reading, verification and writing of a file, the object pool and the ``baselines prune|verify`` command line are in ``pytest_npu_parity.baselines``, with the
machine facts and fingerprints in ``pytest_npu_parity.provenance`` and the module configuration in
``pytest_npu_parity.structure``. ``pytest_npu_parity.baselines`` imports every name of ``store.format`` and ``StoreLock``
(so ``from pytest_npu_parity.baselines import CheckBaseline`` keeps working), and the old import path
``pytest_npu_parity.compact`` re-exports every name of ``store.compact``. This package never imports pytest and never imports a model adapter.
"""

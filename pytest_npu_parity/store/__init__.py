"""Where baselines live: how a recorded reference is kept, found, read, verified and written.

The modules of this package, one per question:

* ``format`` — the file format's constants (``FORMAT``, ``FORMAT_VERSION``, the pool's), the store's
  errors (``BaselineError`` and its kinds) and the data classes of a baseline (``CheckBaseline``,
  ``Baseline``);
* ``baselines`` — ``BaselineStore``: one suite's files (the layout and the file format are described
  there), loading, judging a stored check fresh, writing;
* ``suites`` — ``SuiteStores``: every suite under one root, and what spans the store (temporary files,
  the lock, the object pool, unreferenced objects);
* ``reading`` — reading and verifying one baseline file; ``encoding`` — checks to tensors, records and
  the checksum; ``staleness`` — the differences that make a stored check stale;
* ``pool`` — ``ObjectPool``, the content-addressed objects shared by every file of a store;
* ``files`` — file kinds (never unpickled), atomic writes, walking a store's tree;
* ``lock`` — ``StoreLock``, which serializes the record runs (and ``baselines prune``) of one store;
* ``compact`` — what of a training step's large gradient and parameter leaves a baseline keeps
  (``TrainStore``, the ``@sample`` / ``@stats`` leaves, ``apply_recorded``);
* ``provenance`` — the one-line description of where, when and with what software a baseline was
  recorded (``describe_provenance``; the record itself is collected by ``runtime.machine``);
* ``digests`` — content fingerprints of tensors and modules (``fingerprint_tensors``, ``fingerprint_module``,
  ``module_tensor_digests``); ``summaries`` — order-sensitive input summaries compared within a tolerance;
* ``cli`` — ``python -m pytest_npu_parity baselines {prune,verify}``.

The module configuration is in ``pytest_npu_parity.structure``. The old import paths
``pytest_npu_parity.baselines``, ``pytest_npu_parity.provenance`` and ``pytest_npu_parity.compact``
re-export every name of the modules above. This package never imports pytest and never imports a model
adapter.
"""

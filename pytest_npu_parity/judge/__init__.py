"""How two computations are judged: given the target's and the reference's outputs (and, for the
golden verdict, a golden run's), say whether they agree, by which numbers, and why.

Every judge of the engine lives here, one module per question, in import order:

* ``tolerance`` — when is one element "the same"? ``Tolerance`` (rtol, atol, budget), the defaults
  per dtype and recipe, the ``rtol=… atol=… budget=…`` spec;
* ``msprobe`` — what msprobe (mindstudio-probe 26.2.0) would say: the six columns of its dump compare
  (``MsprobeView``) and the arithmetic of its benchmark standard (the ``golden msprobe`` limit set);
* ``allclose`` — the allclose judge: ``compare`` / ``compare_tensors`` over nested outputs, their
  metrics (max_abs, max_rel, rel_l2, cosine, mismatched, err_ratio), ``LeafResult``,
  ``CompareResult`` and ``ParityError``;
* ``golden_metrics`` — how far one side is from the golden (``SideMetrics``, our sums and ratios);
* ``golden_policy`` — the golden verdict's limits (``GoldenPolicy``, the ``golden …`` and
  ``allclose`` / ``golden`` policy specs);
* ``golden`` — the golden judge: ``judge_golden`` / ``judge_golden_tensors`` (the golden itself is
  computed by ``runtime.golden_run.GoldenRunner``: running a computation is not judging it);
* ``distribution`` — two sets of samples, one permutation-test verdict (``compare_distributions``);
* ``layers`` — the layer check's verdict over the layer records (``judge_layers``, ``LayerPolicy``;
  the records are taken by ``runtime.layer_capture``);
* ``trajectory`` — two training trajectories (loss, global and per-module gradient-norm curves over N
  steps): mean relative loss error, the steps where the curves part, the module that parts first
  (``judge_trajectory``, ``TrajectoryPolicy``; limits measured, see the module).

Which judge applies to a check is decided in one place, ``checks.verdict``. The judges read
outputs as named leaves (``pytest_npu_parity.leaves``) and never run a computation, never import
pytest, and never import a model adapter. The old import paths (``pytest_npu_parity.compare``,
``policy``, ``golden``, ``distribution``, ``layers``) re-export every name of these modules.
"""

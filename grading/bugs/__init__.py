"""Seeded bugs: each module ``<key>_<what>`` holds one assignment function with one realistic mistake (the rest
is the reference), ``LOSES``: the tests it must fail, ``GPU_ONLY`` when a CPU cannot see it, and
``PASSES_ON_GPU``: those of ``LOSES`` that a GPU machine cannot fail it on (the module says why).
``tests/test_grading.py`` checks each against its ``LOSES``; ``make student-repo`` leaves this folder out."""

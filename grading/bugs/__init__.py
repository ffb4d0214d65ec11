"""Seeded bugs: each module ``<key>_<what>`` holds one assignment function with one realistic mistake (the rest
is the reference), ``LOSES``: the tests it must fail, and ``GPU_ONLY`` when a CPU cannot see it.
``tests/test_grading.py`` checks each against its ``LOSES``; ``make student-repo`` leaves this folder out."""

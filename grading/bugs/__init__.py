"""Seeded bugs: each module is one assignment's reference with one realistic mistake, named ``<key>_<what>``.
``tests/test_grading.py`` checks that each loses points; ``make student-repo`` leaves this folder out."""

"""The grader of the course's assignments: ``make grade`` (``python -m grading``). See ``grading/README.md``."""

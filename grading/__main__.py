import sys

from grading.grade import main

sys.exit(main())

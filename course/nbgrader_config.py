# nbgrader configuration of the course directory (nbgrader 0.9; docs: "Configuration options").
# `make assignments` fills source/ and release/ from the labs' exercise cells; on JupyterHub an
# instructor runs nbgrader from this directory (book/instructors.md has the commands). Students need
# the same course id and exchange in their own nbgrader_config.py (the snippet in that chapter).
import os
import warnings

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import GetGrades
from sqlalchemy.exc import SAWarning

try:
    from labkit.course.collect import OwnedCollect
    from labkit.course.feedback import FeedbackWithoutHiddenTests
    from labkit.course.grading_config import sandboxed_grading
    from labkit.course.student_labs import CODE_STUB, TEXT_STUB
    from labkit.course.submit import WholeSubmit
except ImportError as e:  # traitlets would log it and go on without this file: feedback with hidden tests
    raise SystemExit(f"course/nbgrader_config.py needs labkit (pip install -e the course): {e}") from None

c = get_config()  # noqa: F821 - provided by nbgrader when it loads this file

# The folder this file is in is the course directory, wherever it was copied to.
c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.course_id = os.environ.get("NBGRADER_COURSE_ID", "training-at-scale")
# The exchange is a directory every user's server mounts (a shared volume on JupyterHub): instructors
# release into it and collect from it, students fetch from it and submit into it.
c.Exchange.root = os.environ.get("NBGRADER_EXCHANGE", "/srv/nbgrader/exchange")
c.Exchange.timezone = "UTC"
# Each student's own submission: nbgrader collects the newest filed under a name, whoever made it
# (`nbgrader submit --student=NAME`); this collect leaves out a folder its owner filed under another
# name (labkit/course/collect.py).
c.ExchangeFactory.collect = OwnedCollect
# Whole notebooks only: a Submit pressed during a save would file one cut short, which autograde
# cannot read; this submit waits for the save, and refuses what does not read whole (labkit/course/submit.py).
c.ExchangeFactory.submit = WholeSubmit

# A submission is a student's code: autograde runs each in a fresh kernel inside a sandbox (bubblewrap)
# that sees a copy of that submission and nothing of the course, the gradebook, the exchange or the
# grader's home, has no network and no token, and leaves no process behind (labkit/course/sandbox.py).
# Autograde also restores every locked cell from the gradebook and warns only for one the student
# edited: nbgrader's own warns for every untouched hidden-tests cell (labkit/course/overwrite.py).
sandboxed_grading(c)
# nbgrader's gradebook builds a submission's rows before it adds them to the session; SQLAlchemy 2
# warns when a query flushes in between, and nbgrader then adds and commits them (api.py,
# Gradebook.add_submission). Nothing is lost: the scores are read back from the gradebook in
# tests/test_assignments.py.
warnings.filterwarnings("ignore", r"Object of type <Submitted\w+> not in session", SAWarning)
# Autograding runs each submission in a fresh kernel; a cell that runs longer than this is
# interrupted and graded as failed, so an infinite loop costs one timeout, not the grading run.
# The slowest cell, data_parallel's (2 ranks over gloo), takes seconds.
c.ExecutePreprocessor.timeout = int(os.environ.get("NBGRADER_CELL_TIMEOUT", "300"))
c.Execute.interrupt_on_timeout = True
# A kernel that has not answered within the startup timeout fails the whole submission, not a test.
# jupyter_client's 60 s default was seen to run out on a loaded machine (CI: two graders beside a
# 16-process training run on 2 cores); a kernel that starts late is still a correct submission.
c.ExecutePreprocessor.startup_timeout = int(os.environ.get("NBGRADER_STARTUP_TIMEOUT", "300"))

# Students see a stub where a solution was; `raise NotImplementedError()` makes an unanswered
# exercise fail its tests rather than pass by accident (the labs' student form has the same stubs).
c.ClearSolutions.code_stub = {"python": CODE_STUB}
c.ClearSolutions.text_stub = TEXT_STUB

# Feedback: nbgrader's own two steps, and between them the hidden tests taken out again (nbgrader
# leaves them in by design, jupyter/nbgrader#917); labkit/course/feedback.py says how.
c.GenerateFeedback.preprocessors = [GetGrades, FeedbackWithoutHiddenTests, CSSHTMLHeaderPreprocessor]

# nbgrader's settings on every course server (the image installs this file as
# /etc/jupyter/nbgrader_config.py): the course, and the exchange, the shared volume that values.yaml
# mounts there, and the course's collect. An instructor's course directory (course/nbgrader_config.py)
# says the same.
import os

c = get_config()  # noqa: F821 - provided by nbgrader when it loads this file
c.CourseDirectory.course_id = os.environ.get("NBGRADER_COURSE_ID", "training-at-scale")
c.Exchange.root = os.environ.get("NBGRADER_EXCHANGE", "/srv/nbgrader/exchange")
# each student's own submission, also when the formgrader collects (labkit/course/collect.py)
c.ExchangeFactory.collect = "labkit.course.collect.OwnedCollect"
# whole notebooks only, also when Submit is pressed during a save (labkit/course/submit.py)
c.ExchangeFactory.submit = "labkit.course.submit.WholeSubmit"
# an instructor's autograde (the formgrader's too) runs each submission in a sandbox and warns only for
# a locked cell a student edited (labkit/course/sandbox.py, labkit/course/overwrite.py); the pod must allow
# user namespaces for bubblewrap, or autograde refuses in one line (book/instructors.md)
if os.environ.get("LABKIT_INSTRUCTOR") == "1":
    from labkit.course.grading_config import sandboxed_grading

    sandboxed_grading(c)

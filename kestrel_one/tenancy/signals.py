"""What tenancy tells the apps above it, which tenancy itself does not know.

``project_deleting`` is sent inside ``project_delete``'s transaction, before the project's
rows are deleted, so a receiver can still read what belonged to it; one with work for after
commit registers it with ``transaction.on_commit`` itself (the execution app tells the
runners to remove the project's workspace: ``kestrel_one.execution.control``).
"""

from django.dispatch import Signal

project_deleting = Signal()  # sent with project=<the Project about to be deleted>

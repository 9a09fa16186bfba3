"""What a thread tells the apps above it, which threads itself does not know.

``thread_ended`` is sent inside ``thread_end``'s transaction, with the ended thread locked:
a receiver with work for after commit registers it with ``transaction.on_commit`` itself
(the execution app tells the runners: ``kestrel_one.execution.control``).
"""

from django.dispatch import Signal

thread_ended = Signal()  # sent with thread=<the ended Thread>

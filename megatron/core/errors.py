"""The exception for bad user input: a flag value, a missing, unreadable or corrupt file.

Entry points report it as one line naming the rank and no traceback: the message itself names the flag
or file and what to do, so a traceback would only bury it.
"""


class InputError(ValueError):
    """A user-fixable input error; the message names the flag or file and the fix."""

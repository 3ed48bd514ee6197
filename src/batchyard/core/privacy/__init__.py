"""Personal data out of deferred batches before anything is stored or logged.

A deferred batch sits encrypted in the store for up to a day and its text must
never reach a log line, so ``privacy.mode`` is applied at submission time, before
persistence. ``redact`` swaps each finding for a typed placeholder, ``reject``
refuses the whole submission, ``off`` leaves the text alone.

Off-the-shelf scrubbers (Presidio, scrubadub) weigh hundreds of megabytes and
download models, yet missed a spaced card number and left an e-mail's domain
behind; this module is regular expressions plus checksums, each candidate
confirmed by the rule its issuer uses (Luhn for cards, mod-97 for IBANs, the
``ipaddress`` parser, libphonenumber's metadata), because a redactor that
swallows order numbers and years gets switched off.

Kinds and their placeholders (``PLACEHOLDERS``):

==============  =================  ==============================================
kind            placeholder        what
==============  =================  ==============================================
``SECRET``      ``[SECRET]``       API keys and tokens (``sk-…``, AWS ``AKIA…``,
                                   GitHub, Slack, Stripe, Google, JWTs, PEM
                                   private keys, ``Bearer …``, ``password=…``)
``CREDENTIALS`` ``[CREDENTIALS]``  the ``user:password`` part of a URL
``IBAN``        ``[IBAN]``         IBANs, spaced or not, mod-97 checked
``CARD``        ``[CARD]``         13–19 digit card numbers, Luhn checked
``EMAIL``       ``[EMAIL]``        whole address including the domain, also
                                   ``alice [at] example [dot] com``
``SSN``         ``[SSN]``          US social security numbers
``NINO``        ``[NINO]``         UK National Insurance numbers
``MAC``         ``[MAC]``          MAC addresses
``IP``          ``[IP]``           IPv4 and IPv6 addresses
``DOB``         ``[DOB]``          dates after a birth label ("DOB:", "born on")
``PHONE``       ``[PHONE]``        phone numbers (US, GB, DE, FR, IN national
                                   formats and any ``+``/``00`` international one)
``ADDRESS``     ``[ADDRESS]``      "123 Main Street"-style street addresses
==============  =================  ==============================================

The table is in precedence order: a kind higher up is found first and its
findings are blanked out before the next kind looks, so the digits of a card
never also read as a phone number; overlapping matches of one kind merge. A
placeholder holds neither digits nor anything of the input, and redacted text
redacts to itself.
"""

from batchyard.core.privacy.findings import PLACEHOLDERS, Finding, Kind
from batchyard.core.privacy.modes import PrivacyMode, apply, redact_messages
from batchyard.core.privacy.scan import find_personal_data, redact

__all__ = [
    "PLACEHOLDERS",
    "Finding",
    "Kind",
    "PrivacyMode",
    "apply",
    "find_personal_data",
    "redact",
    "redact_messages",
]

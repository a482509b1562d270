# moto server with IAM enforcement switchable at run time (POST /moto-api/reset-auth).
#
# One deviation from stock moto, to match AWS: STS AssumeRoleWithWebIdentity is an unsigned call
# (the web identity token is the credential). moto 5.2 crashes on it (KeyError
# 'HTTP_AUTHORIZATION') once enforcement is on, so an unsigned AssumeRoleWithWebIdentity skips
# moto's signature check here, as AWS does. Every other request is checked as usual.
import sys
from moto.core.authorization import ActionAuthenticatorMixin as _A

_orig = _A._authenticate_and_authorize_action


def _auth(self, cls, resource="*"):
    if self._get_action() == "AssumeRoleWithWebIdentity" and "Authorization" not in self.headers:
        return
    return _orig(self, cls, resource)


_A._authenticate_and_authorize_action = _auth

from moto.server import main  # noqa: E402

main(sys.argv[1:])

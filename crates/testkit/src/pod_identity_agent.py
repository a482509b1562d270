# A stand-in for the EKS Pod Identity agent, for tests: GET <path> with `Authorization: <token>`
# answers the credentials of the role the token is associated with, by assuming that role on the
# moto server (STS AssumeRoleWithWebIdentity), like the agent's AssumeRoleForPodIdentity.
#
# argv: PORT MOTO_URL ASSOCIATIONS_FILE SEEN_FILE EXPIRES_IN_SECONDS
# ASSOCIATIONS_FILE (re-read on every request): {"<token>": {"role": "<arn>", "label": "<name>"}};
# a token not in it -> 401.
# SEEN_FILE: one line per request: the token's label, or "unknown" (never the token).
import datetime
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
from botocore import UNSIGNED
from botocore.config import Config

port, moto, assoc_file, seen_file, expires_in = sys.argv[1:6]
sts = boto3.client("sts", endpoint_url=moto, region_name="us-east-1",
                   config=Config(signature_version=UNSIGNED))


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        token = self.headers.get("Authorization", "")
        with open(assoc_file) as f:
            assoc = json.load(f)
        entry = assoc.get(token)
        with open(seen_file, "a") as f:
            f.write((entry["label"] if entry else "unknown") + "\n")
        if entry is None:
            body = json.dumps({"code": "AccessDeniedException",
                               "message": "token not associated"}).encode()
            self.send_response(401)
        else:
            c = sts.assume_role_with_web_identity(
                RoleArn=entry["role"], RoleSessionName="eks-pod-identity",
                WebIdentityToken="pod-identity-agent-standin")["Credentials"]
            exp = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(
                seconds=int(expires_in))
            body = json.dumps({"AccessKeyId": c["AccessKeyId"],
                               "SecretAccessKey": c["SecretAccessKey"],
                               "Token": c["SessionToken"], "AccountId": "123456789012",
                               "Expiration": exp.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode()
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


ThreadingHTTPServer(("127.0.0.1", int(port)), Handler).serve_forever()

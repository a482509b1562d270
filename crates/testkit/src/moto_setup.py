# Sets up a moto server for a test from a JSON spec on stdin, then (optionally) turns IAM
# enforcement on. Prints {"users": {name: {"access_key_id", "secret_access_key"}},
# "roles": {name: arn}} on stdout.
#
# spec: {"endpoint": URL, "region": R, "buckets": {bucket: {key: text}},
#        "users": {name: [statement, ...]}, "roles": {name: [statement, ...]}, "enforce": bool}
import json
import sys
import urllib.request

import boto3
from botocore.config import Config

spec = json.load(sys.stdin)
E = spec["endpoint"]
R = spec.get("region", "us-east-1")
kw = dict(endpoint_url=E, region_name=R, aws_access_key_id="AKIASETUP000000000000",
          aws_secret_access_key="setup")
iam = boto3.client("iam", **kw)
s3 = boto3.client("s3", config=Config(s3={"addressing_style": "path"}), **kw)
out = {"users": {}, "roles": {}}
trust = {"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow",
    "Principal": {"Federated": "arn:aws:iam::123456789012:oidc-provider/ferry-test"},
    "Action": ["sts:AssumeRoleWithWebIdentity", "sts:TagSession"]}]}
for bucket, objects in spec.get("buckets", {}).items():
    s3.create_bucket(Bucket=bucket)
    for key, text in objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=text.encode())
for name, statements in spec.get("users", {}).items():
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="ferry-test", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": statements}))
    k = iam.create_access_key(UserName=name)["AccessKey"]
    out["users"][name] = {"access_key_id": k["AccessKeyId"],
                          "secret_access_key": k["SecretAccessKey"]}
for name, statements in spec.get("roles", {}).items():
    arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    iam.put_role_policy(RoleName=name, PolicyName="ferry-test", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": statements}))
    out["roles"][name] = arn
if spec.get("enforce", True):
    urllib.request.urlopen(urllib.request.Request(E + "/moto-api/reset-auth", data=b"0",
                                                  headers={"Content-Type": "text/plain"},
                                                  method="POST")).read()
json.dump(out, sys.stdout)

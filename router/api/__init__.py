"""The router's front door: OpenAI HTTP and gRPC, request parsing and checks, errors, API
keys, admission, streamed responses.
"""

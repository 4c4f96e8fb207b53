wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say ok."}],"max_tokens":8}'

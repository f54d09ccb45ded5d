import json, urllib.request, time
from tests.server.conftest import *  # noqa

def test_smoke(server):
    import openai
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0)
    t=time.time()
    r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role":"user","content":"hello"}], max_tokens=8, temperature=0)
    print(r, time.time()-t)
    s = c.chat.completions.create(model=MODEL_NAME, messages=[{"role":"user","content":"hello"}], max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
    for ch in s: print(ch)
    r = c.completions.create(model=MODEL_NAME, prompt=["hello", "world"], max_tokens=5, n=2, logprobs=2)
    print(r)

"""/slots/{id}?action=save|restore on a real server (llama-server's slot files, confined to --slot-save-path):
a slot's cache saved, erased and restored gives the next request its prefix back with the same tokens; file
names that leave the folder, missing and corrupt files, and a server without the folder are refused."""

import json

import openai
import pytest
from test_server import KEY, MODEL, Server


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("slot-files")


@pytest.fixture(scope="module")
def server(tmp_path_factory, saved):
    s = Server(tmp_path_factory.mktemp("serve-slots"), "--slot-save-path", str(saved), "-np", "1")
    yield s
    s.stop()


def post(server, path, body=None):
    r = server.http("POST", path, json.dumps(body) if body is not None else "",
                    headers={"Content-Type": "application/json"})
    return r.status_code, r.json()


def test_save_erase_restore_keeps_the_prefix(server, saved):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    prompt = "def restore(slot):\n    # a long enough prompt to fill a few blocks of the cache\n"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    status, body = post(server, "/slots/0?action=save", {"filename": "one.bin"})
    assert status == 200 and body["n_saved"] > 0 and body["n_written"] == (saved / "one.bin").stat().st_size
    assert post(server, "/slots/0?action=erase")[0] == 200
    status, body = post(server, "/slots/0?action=restore&filename=one.bin")
    assert status == 200 and body["n_restored"] > 0 and "restore_ms" in body["timings"]
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert again.model_extra["timings"]["cache_n"] == again.usage.prompt_tokens - 1  # all but the last token
    assert again.choices[0].text == first.choices[0].text


@pytest.mark.parametrize("name", ["../escape.bin", "a/b.bin", "", ".hidden", "x" * 200, "/etc/passwd"])
def test_file_names_stay_in_the_folder(server, name):
    status, body = post(server, "/slots/0?action=save", {"filename": name})
    assert status == 400 and body["error"]["param"] == "filename"


def test_missing_and_corrupt_files(server, saved):
    assert post(server, "/slots/0?action=restore", {"filename": "nothing.bin"})[0] == 404
    (saved / "junk.bin").write_bytes(b"\x00" * 64)
    status, body = post(server, "/slots/0?action=restore", {"filename": "junk.bin"})
    assert status == 400 and "slot file" in body["error"]["message"]
    assert post(server, "/slots/0?action=dance", {"filename": "x.bin"})[0] == 400

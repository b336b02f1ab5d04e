"""The Files API through the ``openai`` client: listing, paging and deleting files."""

from __future__ import annotations

pytest_plugins = ["server_harness"]


def _upload(client, text: bytes = b"{}\n") -> str:
    return client.files.create(file=("input.jsonl", text), purpose="batch").id


def test_files_deleted_while_paging_through_them_do_not_break_the_listing(client):
    """The client's auto-pagination asks for each page after the last id of the page
    before, so deleting files as they are listed (``for f in files.list(): delete``)
    asks for a page after an id that is gone; that was a 400 'unknown cursor', and the
    files past the first page were never reached."""
    ids = [_upload(client) for _ in range(5)]
    deleted = []
    for listed in client.files.list(purpose="batch", limit=2):  # newest first
        if listed.id not in ids:  # older than this test's files
            break
        client.files.delete(listed.id)
        deleted.append(listed.id)
    assert deleted == ids[::-1]


def test_a_page_after_a_deleted_file_starts_where_that_file_was(client, http):
    """A cursor is a place in the listing: a deleted file's id still says where the next
    page starts, newest first or oldest first."""
    first, second, newest = _upload(client), _upload(client), _upload(client)
    client.files.delete(second)
    page = client.files.list(purpose="batch", after=second, limit=1)  # one page: older files may follow
    assert [f.id for f in page.data] == [first]
    ascending = client.files.list(purpose="batch", after=second, limit=1, order="asc")
    assert [f.id for f in ascending.data] == [newest]
    resp = http.get("/v1/files", params={"after": "not-a-file-id"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "after", resp.text

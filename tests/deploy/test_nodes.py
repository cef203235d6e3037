"""`florist nodes` and `florist certs --add-node`: a fourth box added to a running TLS + auth
federation made for three, registered with every other key in one command, trains in the next
run, and the listing names all four by their keys (issue 42, points 6-7)."""

import shutil
import subprocess

import pytest
from processes import node_configs, submit

from florist.cli import main
from florist.deploy.certs import make_node_key
from florist.deploy.federation import CONNECTION, LocalFederation
from florist.deploy.nodes import Registered, fingerprint, node_table, public_keys
from florist.deploy.spawning import LOCAL_NODE_CONFIG, free_port


def table(out: str) -> dict[str, list[str]]:
    """`florist nodes`' rows by name (the header left out)."""
    rows = [line.split() for line in out.splitlines()[1:]]
    return {row[0]: row[1:] for row in rows}


@pytest.mark.skipif(not shutil.which("ssh-keygen"), reason="compares with ssh-keygen's fingerprint")
def test_a_key_has_ssh_keygens_fingerprint_in_either_form(tmp_path):
    private, public = make_node_key(tmp_path, "box1")
    printed = subprocess.run(["ssh-keygen", "-lf", str(public)], capture_output=True, text=True, check=True).stdout
    assert fingerprint(public.read_bytes()) == printed.split()[1]
    pem = subprocess.run(  # the form the SuperLink keeps a registered key in
        ["ssh-keygen", "-e", "-m", "PKCS8", "-f", str(public)], capture_output=True, check=True
    ).stdout
    assert fingerprint(pem) == printed.split()[1]


def test_the_table_names_nodes_by_key_then_lists_keys_no_node_has(tmp_path):
    keys = {}
    for name in ("box1", "box2", "box3"):
        keys[fingerprint(make_node_key(tmp_path, name)[1].read_bytes())] = tmp_path / f"{name}.pub"
    box1, box2, box3 = keys
    nodes = [
        Registered(7, "offline", "2026-01-01 10:00:00 UTC", box2),
        Registered(5, "online", "now", box1),
        Registered(9, "registered", "never", "SHA256:other", name="laptop"),  # registered elsewhere, with a name
        Registered(3, "online", "now", ""),  # a Flower that lists no keys
    ]
    assert node_table(nodes, public_keys([tmp_path])) == [
        ["?", "3", "?", "online", "now"],
        ["box1", "5", box1, "online", "now"],
        ["box2", "7", box2, "offline", "2026-01-01 10:00:00 UTC"],
        ["laptop", "9", "SHA256:other", "registered", "never"],
        ["box3", "-", box3, "not registered", "never"],
    ]


def test_a_file_that_is_not_a_key_or_one_key_under_two_names_is_named(tmp_path, capsys):
    (tmp_path / "notes.pub").write_text("not a key\n")
    with pytest.raises(ValueError, match=r"notes\.pub is not an OpenSSH public key"):
        public_keys([tmp_path])
    (tmp_path / "notes.pub").unlink()
    public = make_node_key(tmp_path / "keys", "box1")[1]
    shutil.copy(public, tmp_path / "box1-copy.pub")
    with pytest.raises(ValueError, match="the same key under two names"):
        public_keys([tmp_path])


def test_nodes_names_a_missing_connection_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    assert main(["nodes", "--connection", "boxes"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no connection 'boxes' with an address" in err and "(it has: local)" in err


def test_a_fourth_box_added_later_registers_trains_and_is_listed_by_name(tmp_path, capsys, monkeypatch):
    root = tmp_path / "fed"
    with LocalFederation(root, node_configs(3, root), tls=True, auth=True) as fed:
        monkeypatch.setenv("FLWR_HOME", str(fed.flwr_home))  # its connection, `florist-local`
        ca = (fed.certs / "ca.crt").read_bytes()
        assert main(["certs", "--add-node", "partition-3", "--out", str(fed.certs)]) == 0
        said = capsys.readouterr().out
        assert f"florist nodes register --certs {fed.certs}" in said and "ca.crt" in said
        assert (fed.certs / "ca.crt").read_bytes() == ca and not (fed.certs / "ca.key").exists()
        assert main(["certs", "--add-node", "partition-3", "--out", str(fed.certs)]) == 2  # never replaced
        capsys.readouterr()

        folders = ["--certs", str(fed.certs), "--certs", str(fed.keys)]  # the new key; the three the federation made
        args = ["nodes", *folders, "--connection", CONNECTION]
        assert main([args[0], "register", *args[1:]]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert sorted(lines)[:3] == [f"node-{i}: already registered" for i in range(3)]
        assert sorted(lines)[3].startswith("partition-3: registered, node id ")
        assert main([args[0], "register", *args[1:]]) == 0  # again: every key is registered already
        assert capsys.readouterr().out.count("already registered") == 4
        assert main(args) == 0
        assert table(capsys.readouterr().out)["partition-3"][2:] == ["registered", "never"]

        fed.node_configs.append(LOCAL_NODE_CONFIG | node_configs(4, root)[3])  # node key partition-3
        fed.node_ports.append(free_port())
        fed.nodes.append(None)
        fed.start_node(3, private_key=fed.certs / "keys" / "partition-3")
        fed.wait_for_nodes(4, timeout=180)  # a node's start took over 60 s at load 18
        results = submit(fed, tmp_path / "out", **{"num-server-rounds": 1, "min-nodes": 4})
        assert results["complete"] and "partition-3" in {c["client"] for c in results["clients"]}

        assert main(args) == 0
        listed = table(capsys.readouterr().out)
        assert sorted(listed) == ["node-0", "node-1", "node-2", "partition-3"]
        for name, (node_id, key, status, seen) in listed.items():
            pub = fed.certs / "keys" / f"{name}.pub" if name == "partition-3" else fed.keys / f"{name}.pub"
            assert node_id.isdigit() and key == fingerprint(pub.read_bytes()) and (status, seen) == ("online", "now")

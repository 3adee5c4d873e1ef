//! Three `tidings-tcp-node` processes on loopback: load, SIGKILL one, check that no acknowledged message
//! was lost and that the cluster keeps serving; and the same stop planned, its leaderships handed off
//! first, after which every channel takes its next append at once.
#![allow(clippy::disallowed_methods)] // Waiting on real processes needs the wall clock.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tidings::node::NodeConfig;
use tidings::types::{ChannelId, ChannelType, NodeId};

struct Process {
    child: Child,
    client: SocketAddr,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` distinct free loopback addresses: all held at once while they are chosen, so that no two are the
/// same port (a port let go may be handed out again at once).
fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    listeners.iter().map(|l| l.local_addr().unwrap()).collect()
}

/// The nodes' logs (their stderr), for a failure's message: a node that could not start says why there.
fn node_logs(dir: &Path) -> String {
    (1..=3)
        .map(|id| {
            let log = std::fs::read_to_string(dir.join(format!("node-{id}.log"))).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            format!("--- node {id}:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Sends one command line; returns the reply lines (through `END` for reads).
fn ask(addr: SocketAddr, line: &str) -> Option<Vec<String>> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    stream.write_all(format!("{line}\n").as_bytes()).ok()?;
    let mut reader = BufReader::new(stream);
    let mut lines = Vec::new();
    loop {
        let mut reply = String::new();
        if reader.read_line(&mut reply).ok()? == 0 {
            return None;
        }
        let reply = reply.trim_end().to_owned();
        let done = !reply.starts_with("REC ");
        lines.push(reply);
        if done {
            return Some(lines);
        }
    }
}

/// Retries `line` until the reply starts with `OK`; returns it. Fails with the nodes' logs (in `dir`).
fn until_ok(dir: &Path, addr: SocketAddr, line: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = None;
    loop {
        if let Some(reply) = ask(addr, line) {
            if reply[0].starts_with("OK") {
                return reply[0].clone();
            }
            last = Some(reply);
        }
        assert!(Instant::now() < deadline, "{line}: never OK (last reply {last:?})\n{}", node_logs(dir));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Starts three nodes, each logging to `dir`, with data under it.
fn start_three(dir: &Path) -> (Vec<NodeId>, Vec<Option<Process>>) {
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let addrs = free_addrs(ids.len() * 2);
    let (peers, clients) = addrs.split_at(ids.len());
    let peer_list =
        ids.iter().zip(peers).map(|(id, addr)| format!("{}={addr}", id.get())).collect::<Vec<_>>().join(",");
    let processes: Vec<Option<Process>> = ids
        .iter()
        .zip(clients)
        .map(|(id, client)| {
            let log = std::fs::File::create(dir.join(format!("node-{}.log", id.get()))).unwrap();
            let child = Command::new(env!("CARGO_BIN_EXE_tidings-tcp-node"))
                .args(["--id", &id.get().to_string(), "--peers", &peer_list, "--client", &client.to_string()])
                .args(["--data", &dir.join(id.get().to_string()).to_string_lossy()])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
            Some(Process { child, client: *client })
        })
        .collect();
    (ids, processes)
}

fn client(i: usize, processes: &[Option<Process>]) -> SocketAddr {
    processes[i].as_ref().unwrap().client
}

/// Where `name`'s replicas go, its leader first.
fn placement(ids: &[NodeId], name: &str) -> Vec<NodeId> {
    NodeConfig::new(ids[0], ids.to_vec()).channel_placement(&ChannelId::new(ChannelType::GROUP, name).unwrap())
}

/// Creates `count` channels and appends 60 messages over them, through every node in turn.
fn channels_with_messages(dir: &Path, processes: &[Option<Process>], count: usize) -> (Vec<String>, Vec<Acked>) {
    let channels: Vec<String> = (0..count).map(|i| format!("tcp-{i}")).collect();
    for name in &channels {
        until_ok(dir, client(0, processes), &format!("CREATE {name}"));
    }
    let mut acked = Vec::new();
    for i in 0..60 {
        let name = &channels[i % channels.len()];
        let payload = format!("before-{i}");
        let reply = until_ok(dir, client(i % 3, processes), &format!("APPEND {name} {payload}"));
        acked.push((name.clone(), reply[3..].parse().unwrap(), payload));
    }
    (channels, acked)
}

/// A message acknowledged: channel, seq, payload.
type Acked = (String, u64, String);

/// Every acknowledged message is readable from a live replica of its channel (nodes 1 and 2).
fn assert_readable(ids: &[NodeId], processes: &[Option<Process>], acked: &[Acked]) {
    for (name, seq, payload) in acked {
        let live: Vec<usize> =
            placement(ids, name).iter().map(|n| usize::try_from(n.get() - 1).unwrap()).filter(|i| *i < 2).collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        let wanted = format!("REC {seq} {payload}");
        'found: loop {
            for i in &live {
                if ask(client(*i, processes), &format!("READ {name}")).is_some_and(|lines| lines.contains(&wanted)) {
                    break 'found;
                }
            }
            assert!(Instant::now() < deadline, "acknowledged {name} {seq} {payload} lost");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn sigkill_one_of_three_loses_no_acknowledged_message() {
    let dir = tempfile::tempdir().unwrap();
    let (ids, mut processes) = start_three(dir.path());
    let (channels, mut acked) = channels_with_messages(dir.path(), &processes, 6);
    // SIGKILL node 3.
    processes[2] = None;
    let served: Vec<&String> = channels.iter().filter(|c| placement(&ids, c)[0] != ids[2]).collect();
    assert!(!served.is_empty());
    for i in 0..30 {
        let name = served[i % served.len()];
        let payload = format!("after-{i}");
        let reply = until_ok(dir.path(), client(i % 2, &processes), &format!("APPEND {name} {payload}"));
        acked.push((name.clone(), reply[3..].parse().unwrap(), payload));
    }
    assert_readable(&ids, &processes, &acked);
}

#[test]
fn a_node_that_hands_off_before_its_sigkill_leaves_every_channel_taking_its_next_append() {
    let dir = tempfile::tempdir().unwrap();
    let (ids, mut processes) = start_three(dir.path());
    let (channels, mut acked) = channels_with_messages(dir.path(), &processes, 6);
    assert!(channels.iter().any(|c| placement(&ids, c)[0] == ids[2]), "node 3 leads some channel");
    assert_eq!(until_ok(dir.path(), client(2, &processes), "HANDOFF"), "OK");
    processes[2] = None;
    // No failover to wait for: the first try commits, on every channel.
    for (i, name) in channels.iter().enumerate() {
        let payload = format!("after-{i}");
        let reply = ask(client(i % 2, &processes), &format!("APPEND {name} {payload}"));
        let reply = reply.and_then(|lines| lines.into_iter().next()).unwrap_or_default();
        assert!(reply.starts_with("OK "), "{name}: {reply}\n{}", node_logs(dir.path()));
        acked.push((name.clone(), reply[3..].parse().unwrap(), payload));
    }
    assert_readable(&ids, &processes, &acked);
}

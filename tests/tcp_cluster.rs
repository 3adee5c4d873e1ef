//! Three `tidings-tcp-node` processes on loopback: load, SIGKILL one, check that no acknowledged message
//! was lost and that the cluster keeps serving.
#![allow(clippy::disallowed_methods)] // Waiting on real processes needs the wall clock.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
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

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// Sends one command line; returns the reply lines (through `END` for reads).
fn ask(addr: SocketAddr, line: &str) -> Option<Vec<String>> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
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

/// Retries `line` until the reply starts with `OK`; returns it.
fn until_ok(addr: SocketAddr, line: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(reply) = ask(addr, line) {
            if reply[0].starts_with("OK") {
                return reply[0].clone();
            }
        }
        assert!(Instant::now() < deadline, "{line}: never OK");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sigkill_one_of_three_loses_no_acknowledged_message() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let peers: Vec<SocketAddr> = ids.iter().map(|_| free_addr()).collect();
    let peer_list =
        ids.iter().zip(&peers).map(|(id, addr)| format!("{}={addr}", id.get())).collect::<Vec<_>>().join(",");
    let mut processes: Vec<Option<Process>> = ids
        .iter()
        .map(|id| {
            let client = free_addr();
            let child = Command::new(env!("CARGO_BIN_EXE_tidings-tcp-node"))
                .args(["--id", &id.get().to_string(), "--peers", &peer_list, "--client", &client.to_string()])
                .args(["--data", &dir.path().join(id.get().to_string()).to_string_lossy()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            Some(Process { child, client })
        })
        .collect();
    let client = |i: usize, processes: &[Option<Process>]| processes[i].as_ref().unwrap().client;
    let channels: Vec<String> = (0..6).map(|i| format!("tcp-{i}")).collect();
    for name in &channels {
        until_ok(client(0, &processes), &format!("CREATE {name}"));
    }
    let mut acked: Vec<(String, u64, String)> = Vec::new();
    for i in 0..60 {
        let name = &channels[i % channels.len()];
        let payload = format!("before-{i}");
        let reply = until_ok(client(i % 3, &processes), &format!("APPEND {name} {payload}"));
        acked.push((name.clone(), reply[3..].parse().unwrap(), payload));
    }
    // SIGKILL node 3.
    processes[2] = None;
    let placement = |name: &str| {
        NodeConfig::new(ids[0], ids.clone()).channel_placement(&ChannelId::new(ChannelType::GROUP, name).unwrap())
    };
    let served: Vec<&String> = channels.iter().filter(|c| placement(c)[0] != ids[2]).collect();
    assert!(!served.is_empty());
    for i in 0..30 {
        let name = served[i % served.len()];
        let payload = format!("after-{i}");
        let reply = until_ok(client(i % 2, &processes), &format!("APPEND {name} {payload}"));
        acked.push((name.clone(), reply[3..].parse().unwrap(), payload));
    }
    // Every acknowledged message is readable from a live replica of its channel.
    for (name, seq, payload) in &acked {
        let live: Vec<usize> =
            placement(name).iter().map(|n| usize::try_from(n.get() - 1).unwrap()).filter(|i| *i < 2).collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        let wanted = format!("REC {seq} {payload}");
        'found: loop {
            for i in &live {
                if ask(client(*i, &processes), &format!("READ {name}")).is_some_and(|lines| lines.contains(&wanted)) {
                    break 'found;
                }
            }
            assert!(Instant::now() < deadline, "acknowledged {name} {seq} {payload} lost");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

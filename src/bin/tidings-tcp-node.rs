//! One tidings node per process, over TCP on loopback (std::net + threads): the transport example.
//!
//! ```text
//! tidings-tcp-node --id 1 --peers 1=127.0.0.1:7101,2=127.0.0.1:7102,3=127.0.0.1:7103 \
//!                  --client 127.0.0.1:7201 --data /tmp/node-1
//! ```
//!
//! `--founders 1,2,3` names the nodes the cluster was first started with (`NodeConfig::founders`;
//! default: every node of `--peers`): give it to every node once nodes have been added or removed, and
//! `--join` to a node that starts into the running cluster on an empty directory
//! (`NodeConfig::join_existing`; see `docs/operations.md`, "Adding and removing nodes").
//!
//! Peers talk length-prefixed frames (`u32` length, then the frame) after a handshake of the sender's
//! node id (`u64`). The client port speaks a line protocol for tests and demos:
//! `CREATE <channel>` → `OK`, `APPEND <channel> <payload>` → `OK <seq>`, `READ <channel>` → `REC <seq>
//! <payload>`… then `END`, and `HANDOFF` → `OK` once the node leads nothing (`Node::hand_off_leaderships`:
//! what to send before stopping the process for a restart); errors are `ERR <reason>`.
#![allow(clippy::disallowed_methods)] // A runtime shell.

use bytes::Bytes;
use crossbeam_channel::{bounded, Receiver, Sender};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tidings::channel::machine::AppendRecord;
use tidings::node::NodeConfig;
use tidings::slot::model::{ChannelFlags, ChannelInfo};
use tidings::types::{ChannelId, ChannelType, NodeId, Seq};
use tidings::{Node, StorageOptions, Transport};

/// Largest frame accepted from a peer connection (the node checks again, tighter).
const FRAME_BYTES_MAX: usize = 32 << 20;
/// Frames queued per peer; beyond it frames are dropped (the protocols resend).
const PEER_QUEUE: usize = 8192;

struct TcpTransport {
    queues: BTreeMap<NodeId, Sender<Bytes>>,
}

impl Transport for TcpTransport {
    fn send(&self, to: NodeId, frame: Bytes) {
        if let Some(queue) = self.queues.get(&to) {
            let _ = queue.try_send(frame);
        }
    }
}

/// Keeps one outbound connection to `peer`, reconnecting with a short back-off.
fn peer_writer(me: NodeId, addr: SocketAddr, frames: Receiver<Bytes>) {
    let mut stream: Option<TcpStream> = None;
    while let Ok(frame) = frames.recv() {
        for _ in 0..2 {
            if stream.is_none() {
                stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok().and_then(|mut s| {
                    s.set_nodelay(true).ok()?;
                    s.write_all(&me.get().to_le_bytes()).ok()?;
                    Some(s)
                });
                if stream.is_none() {
                    std::thread::sleep(Duration::from_millis(50));
                    break; // Drop this frame: the peer is down.
                }
            }
            let len = u32::try_from(frame.len()).unwrap_or(u32::MAX).to_le_bytes();
            let written = stream.as_mut().map(|s| s.write_all(&len).and_then(|()| s.write_all(&frame)));
            match written {
                Some(Ok(())) => break,
                _ => stream = None,
            }
        }
    }
}

/// Reads frames from one inbound peer connection into the node.
fn peer_reader(mut stream: TcpStream, node: Arc<OnceLock<Node>>) {
    let mut id = [0u8; 8];
    if stream.read_exact(&mut id).is_err() {
        return;
    }
    let from = NodeId::new(u64::from_le_bytes(id));
    let mut len = [0u8; 4];
    loop {
        if stream.read_exact(&mut len).is_err() {
            return;
        }
        let len = usize::try_from(u32::from_le_bytes(len)).unwrap_or(usize::MAX);
        if len > FRAME_BYTES_MAX {
            return; // Not a peer we can talk to.
        }
        let mut frame = vec![0u8; len];
        if stream.read_exact(&mut frame).is_err() {
            return;
        }
        if let Some(node) = node.get() {
            node.handle_frame(from, Bytes::from(frame));
        }
    }
}

fn client(stream: TcpStream, node: Arc<OnceLock<Node>>) {
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let reader = BufReader::new(stream);
    for line in reader.lines() {
        let Ok(line) = line else { return };
        let Some(node) = node.get() else { return };
        let reply = answer(node, &line);
        if writer.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// How long `HANDOFF` waits for the node to lead nothing.
const HAND_OFF_TIMEOUT: Duration = Duration::from_secs(20);

fn answer(node: &Node, line: &str) -> String {
    if line == "HANDOFF" {
        return match node.hand_off_leaderships(HAND_OFF_TIMEOUT) {
            Ok(()) => "OK\n".into(),
            Err(e) => format!("ERR {e}\n"),
        };
    }
    let mut parts = line.splitn(3, ' ');
    let (verb, name, rest) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let Ok(channel) = ChannelId::new(ChannelType::GROUP, name) else { return "ERR bad channel\n".into() };
    match verb {
        "CREATE" => match node.create_channel(ChannelInfo { channel, flags: ChannelFlags::default() }) {
            Ok(()) => "OK\n".into(),
            Err(e) => format!("ERR {e}\n"),
        },
        "APPEND" => {
            let record = AppendRecord { idempotency_key: None, payload: Bytes::from(rest.to_owned()) };
            match node.append(channel, vec![record]).and_then(|h| h.wait()) {
                Ok(seqs) => format!("OK {}\n", seqs[0].get()),
                Err(e) => format!("ERR {e}\n"),
            }
        }
        "READ" => {
            // Every committed message, page by page (a read returns at most `read_records_max`).
            let (mut out, mut from) = (String::new(), Seq::new(1));
            loop {
                match node.read(&channel, from, usize::MAX) {
                    Ok(page) if page.is_empty() => break,
                    Ok(page) => {
                        from = page.last().map_or(from, |r| r.seq.next());
                        for r in &page {
                            out.push_str(&format!("REC {} {}\n", r.seq.get(), String::from_utf8_lossy(&r.payload)));
                        }
                    }
                    Err(e) => return format!("ERR {e}\n"),
                }
            }
            out.push_str("END\n");
            out
        }
        _ => "ERR unknown command\n".into(),
    }
}

fn arg(args: &[String], name: &str) -> String {
    let at = args.iter().position(|a| a == name).unwrap_or_else(|| panic!("missing {name}"));
    args.get(at + 1).cloned().unwrap_or_else(|| panic!("missing value of {name}"))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let me = NodeId::new(arg(&args, "--id").parse().expect("--id is a number"));
    let peers: BTreeMap<NodeId, SocketAddr> = arg(&args, "--peers")
        .split(',')
        .map(|p| {
            let (id, addr) = p.split_once('=').expect("--peers is id=addr,...");
            (NodeId::new(id.parse().expect("peer id")), addr.parse().expect("peer address"))
        })
        .collect();
    let client_addr: SocketAddr = arg(&args, "--client").parse().expect("--client address");
    let data = arg(&args, "--data");

    let node = Arc::new(OnceLock::new());
    let listener = TcpListener::bind(peers[&me]).expect("bind peer address");
    let clients = TcpListener::bind(client_addr).expect("bind client address");
    let mut queues = BTreeMap::new();
    for (id, addr) in &peers {
        if *id != me {
            let (tx, rx) = bounded(PEER_QUEUE);
            queues.insert(*id, tx);
            let addr = *addr;
            std::thread::spawn(move || peer_writer(me, addr, rx));
        }
    }
    {
        let node = Arc::clone(&node);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let node = Arc::clone(&node);
                std::thread::spawn(move || peer_reader(stream, node));
            }
        });
    }
    let mut config = NodeConfig::new(me, peers.keys().copied().collect());
    if let Some(at) = args.iter().position(|a| a == "--founders") {
        let list = args.get(at + 1).expect("missing value of --founders");
        config.founders = list.split(',').map(|id| NodeId::new(id.parse().expect("founder id"))).collect();
    }
    config.join_existing = args.iter().any(|a| a == "--join");
    let started =
        Node::start(config, StorageOptions::new(data), Arc::new(TcpTransport { queues })).expect("node starts");
    let _ = node.set(started);
    eprintln!("node {me} ready: peers {:?}, clients on {client_addr}", peers);
    for stream in clients.incoming().flatten() {
        let node = Arc::clone(&node);
        std::thread::spawn(move || client(stream, node));
    }
}

//! Frames on the wire, and the handshake that opens every connection.
//!
//! - A **handshake** ([`Hello`]) is the first thing sent on a new connection: the magic
//!   [`MAGIC`], the [`PROTOCOL_VERSION`], then a body of at most [`MAX_HANDSHAKE_BYTES`]
//!   saying who connects (role, rank, world size, listening port), a fresh nonce, and
//!   what it runs (the plan fingerprint and arguments). Then the challenge–response
//!   ([`super::auth`]), as frames: the accepting end's `challenge` (its nonce and proof),
//!   the connecting end's `proof`, and the accepting end's `welcome` once it took the
//!   connection. The secret itself is never sent.
//! - After it, **frames**: a kind byte, a tag of at most [`MAX_TAG_BYTES`], a payload of at
//!   most [`MAX_FRAME_BYTES`]. Payloads are read as they arrive, so a length taken from
//!   the wire is never allocated up front.

use super::auth::{Nonce, NONCE_BYTES};
use std::io::{Read, Write};

/// The first bytes of every mold connection.
pub const MAGIC: [u8; 8] = *b"MOLDDIST";
/// Bumped whenever the handshake or frames change; processes of another version are
/// refused in one line naming both versions. 2: the secret is proven (HMAC over nonces)
/// rather than sent.
pub const PROTOCOL_VERSION: u32 = 2;
/// Largest handshake body.
pub const MAX_HANDSHAKE_BYTES: usize = 64 << 10;
/// Largest tag of a frame.
pub const MAX_TAG_BYTES: usize = 1 << 10;
/// Largest frame payload: 4 GiB, far above what a run sends (a part's activations: a
/// few (tokens × hidden) tensors, e.g. 4096 × 3072 f32 = 48 MiB at 1024²).
pub const MAX_FRAME_BYTES: u64 = 4 << 30;
/// Largest shared secret (`MOLD_DIST_SECRET`).
pub const MAX_SECRET_BYTES: usize = 1 << 10;

pub(crate) const KIND_DATA: u8 = 0;
pub(crate) const KIND_ABORT: u8 = 1;
pub(crate) const KIND_BYE: u8 = 2;

/// Tags of the handshake's frames.
pub(crate) const TAG_CHALLENGE: &str = "challenge";
pub(crate) const TAG_PROOF: &str = "proof";
pub(crate) const TAG_WELCOME: &str = "welcome";

fn invalid(m: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, m)
}

pub(crate) fn write_frame(
    w: &mut impl Write,
    kind: u8,
    tag: &str,
    payload: &[u8],
) -> std::io::Result<()> {
    if tag.len() > MAX_TAG_BYTES || payload.len() as u64 > MAX_FRAME_BYTES {
        return Err(invalid(format!(
            "message `{tag}` of {} bytes is over the limit ({MAX_FRAME_BYTES} bytes)",
            payload.len()
        )));
    }
    w.write_all(&[kind])?;
    w.write_all(&(tag.len() as u32).to_le_bytes())?;
    w.write_all(tag.as_bytes())?;
    w.write_all(&(payload.len() as u64).to_le_bytes())?;
    w.write_all(payload)?;
    w.flush()
}

/// Reads exactly `n` bytes, growing the buffer as they arrive (not allocated up front).
fn read_n(r: &mut impl Read, n: u64) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(n.min(1 << 20) as usize);
    let got = r.take(n).read_to_end(&mut out)?;
    if (got as u64) < n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("connection ended {} bytes into a {n}-byte message", got),
        ));
    }
    Ok(out)
}

pub(crate) fn read_frame(r: &mut impl Read) -> std::io::Result<(u8, String, Vec<u8>)> {
    let mut kind = [0u8; 1];
    r.read_exact(&mut kind)?;
    if kind[0] > KIND_BYE {
        return Err(invalid(format!("not a mold message (kind {})", kind[0])));
    }
    let mut n4 = [0u8; 4];
    r.read_exact(&mut n4)?;
    let n = u32::from_le_bytes(n4) as usize;
    if n > MAX_TAG_BYTES {
        return Err(invalid(format!("not a mold message (a tag of {n} bytes)")));
    }
    let tag = read_n(r, n as u64)?;
    let mut n8 = [0u8; 8];
    r.read_exact(&mut n8)?;
    let len = u64::from_le_bytes(n8);
    if len > MAX_FRAME_BYTES {
        return Err(invalid(format!(
            "a message of {len} bytes is over the limit of {MAX_FRAME_BYTES}"
        )));
    }
    let payload = read_n(r, len)?;
    let tag = String::from_utf8(tag).map_err(|_| invalid("not a mold message (tag)".into()))?;
    Ok((kind[0], tag, payload))
}

/// Who opens a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A process joining at process 0.
    Join,
    /// A process connecting to a lower-ranked one after the rendezvous.
    Peer,
}

/// The handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub role: Role,
    pub rank: u32,
    pub world: u32,
    /// Where the sender listens for higher-ranked processes (joins only).
    pub port: u16,
    /// The sender's fresh nonce, for the challenge–response.
    pub nonce: Nonce,
    /// `key=value;…`: what the sender runs.
    pub run: String,
}

/// Why a handshake was not accepted.
#[derive(Debug)]
pub(crate) enum Reject {
    /// Not a mold process (bad magic, broken or oversized body), or silent too long.
    Stray(String),
    /// A mold process that must not join (another protocol version, wrong secret): told
    /// so, then dropped.
    Refused(String),
}

/// Sends the handshake; returns its body (what the proofs cover).
pub(crate) fn write_hello(w: &mut impl Write, h: &Hello) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    body.push(match h.role {
        Role::Join => 0u8,
        Role::Peer => 1,
    });
    body.extend_from_slice(&h.rank.to_le_bytes());
    body.extend_from_slice(&h.world.to_le_bytes());
    body.extend_from_slice(&h.port.to_le_bytes());
    body.extend_from_slice(&h.nonce);
    body.extend_from_slice(&(h.run.len() as u32).to_le_bytes());
    body.extend_from_slice(h.run.as_bytes());
    if body.len() > MAX_HANDSHAKE_BYTES {
        return Err(invalid(format!(
            "the run description is too long for the handshake ({} bytes, at most {MAX_HANDSHAKE_BYTES})",
            body.len()
        )));
    }
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    w.write_all(&out)?;
    w.flush()?;
    Ok(body)
}

/// Reads and checks a handshake: magic, version, bounded body. Returns it with its body's
/// bytes (what the proofs cover); the secret is checked after, by the challenge–response.
pub(crate) fn read_hello(r: &mut impl Read) -> Result<(Hello, Vec<u8>), Reject> {
    let stray = |what: &str, e: std::io::Error| Reject::Stray(format!("{what}: {e}"));
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic)
        .map_err(|e| stray("no handshake", e))?;
    if magic != MAGIC {
        return Err(Reject::Stray(
            "not a mold process (wrong magic bytes)".into(),
        ));
    }
    let mut n4 = [0u8; 4];
    r.read_exact(&mut n4)
        .map_err(|e| stray("broken handshake", e))?;
    let version = u32::from_le_bytes(n4);
    if version != PROTOCOL_VERSION {
        return Err(Reject::Refused(format!(
            "it speaks protocol version {version}, this process {PROTOCOL_VERSION}: run the \
             same mold build everywhere"
        )));
    }
    r.read_exact(&mut n4)
        .map_err(|e| stray("broken handshake", e))?;
    let len = u32::from_le_bytes(n4) as usize;
    if len > MAX_HANDSHAKE_BYTES {
        return Err(Reject::Stray(format!(
            "a handshake of {len} bytes (at most {MAX_HANDSHAKE_BYTES})"
        )));
    }
    let body = read_n(r, len as u64).map_err(|e| stray("broken handshake", e))?;
    let h = parse_body(&body).ok_or_else(|| Reject::Stray("malformed handshake".into()))?;
    Ok((h, body))
}

struct Body<'a>(&'a [u8]);

impl Body<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(a)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
}

fn parse_body(b: &[u8]) -> Option<Hello> {
    let mut c = Body(b);
    let role = match c.take(1)?[0] {
        0 => Role::Join,
        1 => Role::Peer,
        _ => return None,
    };
    let rank = c.u32()?;
    let world = c.u32()?;
    let port = u16::from_le_bytes(c.take(2)?.try_into().ok()?);
    let nonce: Nonce = c.take(NONCE_BYTES)?.try_into().ok()?;
    let m = c.u32()? as usize;
    let run = String::from_utf8(c.take(m)?.to_vec()).ok()?;
    if !c.0.is_empty() {
        return None;
    }
    Some(Hello {
        role,
        rank,
        world,
        port,
        nonce,
        run,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello() -> Hello {
        Hello {
            role: Role::Join,
            rank: 1,
            world: 2,
            port: 4000,
            nonce: [7; NONCE_BYTES],
            run: "plan=abc".into(),
        }
    }

    #[test]
    fn handshake_round_trips_without_the_secret() {
        let mut b = Vec::new();
        let body = write_hello(&mut b, &hello()).unwrap();
        assert_eq!(
            read_hello(&mut b.as_slice()).unwrap(),
            (hello(), body.clone())
        );
        assert_eq!(&b[16..], &body[..]);
    }

    #[test]
    fn bad_handshakes_are_stray_or_refused() {
        let mut b = Vec::new();
        write_hello(&mut b, &hello()).unwrap();
        let mut v2 = b.clone();
        v2[8] = 9;
        assert!(
            matches!(read_hello(&mut v2.as_slice()), Err(Reject::Refused(m)) if m.contains("version 9") && !m.contains('\n'))
        );
        let mut huge = b[..12].to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            matches!(read_hello(&mut huge.as_slice()), Err(Reject::Stray(m)) if m.contains("4294967295 bytes"))
        );
        let mut short = b.clone();
        short.pop();
        assert!(matches!(
            read_hello(&mut short.as_slice()),
            Err(Reject::Stray(_))
        ));
        assert!(
            matches!(read_hello(&mut &b"GET / HTTP/1.1\r\n"[..]), Err(Reject::Stray(m)) if m.contains("magic"))
        );
    }

    #[test]
    fn frames_bound_their_lengths_before_reading() {
        let mut b = Vec::new();
        write_frame(&mut b, KIND_DATA, "t", b"xyz").unwrap();
        assert_eq!(
            read_frame(&mut b.as_slice()).unwrap(),
            (KIND_DATA, "t".to_string(), b"xyz".to_vec())
        );
        // A payload length over the cap, and one under it without the bytes behind it.
        let mut huge = vec![KIND_DATA, 1, 0, 0, 0, b't'];
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        let e = read_frame(&mut huge.as_slice()).unwrap_err().to_string();
        assert!(e.contains("over the limit"), "{e}");
        let mut lying = vec![KIND_DATA, 1, 0, 0, 0, b't'];
        lying.extend_from_slice(&(MAX_FRAME_BYTES - 1).to_le_bytes());
        let e = read_frame(&mut lying.as_slice()).unwrap_err().to_string();
        assert!(e.contains("connection ended 0 bytes into"), "{e}");
        let long_tag = [vec![KIND_DATA], 5000u32.to_le_bytes().to_vec()].concat();
        assert!(read_frame(&mut long_tag.as_slice()).is_err());
        assert!(read_frame(&mut &[7u8][..]).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = read_frame(&mut bytes.as_slice());
            let _ = read_hello(&mut bytes.as_slice());
            let mut h = MAGIC.to_vec();
            h.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            h.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            h.extend_from_slice(&bytes);
            let _ = read_hello(&mut h.as_slice());
        }
    }
}

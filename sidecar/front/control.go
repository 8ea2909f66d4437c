package main

// The control link to the sidecar's Python process: one Unix stream socket
// carrying length-prefixed frames both ways (docs/sidecar.md, "The compiled
// front"). Every frame is a 9-byte header, the frame's kind, the request's id
// and the payload's length (little-endian), then the payload.
//
// front -> sidecar: 'A' arrival (route byte + the client's body), 'P' progress
// (tokens seen, TTFT when this read held the first token, then the token gaps),
// 'E' end (outcome, tokens, end-to-end, time to the engine, first relay write).
// 'S' sent: a request this front sent to the engine on arrival, inside the
// allowance (route byte + body).
// sidecar -> front: 'G' grant (vLLM priority), 'B' grant with a rewritten body,
// 'R' refusal (HTTP status + an error body in vLLM's shape), 'C' allowance.
//
// The allowance: while no online request is held, the dispatcher would submit
// any arrival that finds a sequence slot and KV blocks free, so the sidecar
// hands that rule to the front ahead of time: up to N requests using up to B KV
// blocks in all may go straight to the engine at the online priority, counted
// from the sidecar's seen-th 'S' frame (the front subtracts what it sent since).
// The front uses it only while none of its own arrivals awaits a reply, so a
// newcomer never overtakes a held request.

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"sync"
)

const headerLen = 9

const (
	kindArrival  = 'A'
	kindProgress = 'P'
	kindEnd      = 'E'
	kindGrant    = 'G'
	kindBody     = 'B'
	kindRefuse   = 'R'
	kindSent     = 'S'
	kindAllow    = 'C'
)

const allowanceLen = 28

// Outcomes of an 'E' frame.
const (
	outcomeOK          = 'o'
	outcomeEngineError = 'e'
	outcomeClientError = 'x' // the engine refused the request (4xx)
	outcomeCancelled   = 'c'
)

// reply is the sidecar's answer to one arrival.
type reply struct {
	kind    byte
	payload []byte
}

// allowance is what the front may send on arrival (see the file's comment).
type allowance struct {
	seen        uint32 // 'S' frames the sidecar had registered when it computed this
	sent        uint32 // 'S' frames sent
	count       int
	blocks      int
	tokPerByte  float64
	blockSize   int
	priority    int
	outstanding []int // KV blocks of each request sent after the seen-th, oldest first
}

type control struct {
	conn    net.Conn
	out     chan []byte
	mu      sync.Mutex
	pending map[uint32]chan reply
	allow   allowance
}

func dialControl(path string) (*control, error) {
	conn, err := net.Dial("unix", path)
	if err != nil {
		return nil, fmt.Errorf("control socket %s: %w", path, err)
	}
	return &control{conn: conn, out: make(chan []byte, 8192), pending: make(map[uint32]chan reply)}, nil
}

// run carries frames both ways until the link breaks; it returns why.
func (c *control) run() error {
	errs := make(chan error, 2)
	go func() { errs <- c.write() }()
	go func() { errs <- c.read() }()
	return <-errs
}

// write sends queued frames, flushing once the queue is empty so that the
// frames of a burst leave in few writes.
func (c *control) write() error {
	w := bufio.NewWriterSize(c.conn, 64<<10)
	for frame := range c.out {
		if _, err := w.Write(frame); err != nil {
			return err
		}
		for more := true; more; {
			select {
			case f := <-c.out:
				if _, err := w.Write(f); err != nil {
					return err
				}
			default:
				more = false
			}
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}
	return nil
}

func (c *control) read() error {
	r := bufio.NewReaderSize(c.conn, 64<<10)
	var head [headerLen]byte
	for {
		if _, err := io.ReadFull(r, head[:]); err != nil {
			if errors.Is(err, io.EOF) {
				return errors.New("the sidecar closed the control socket")
			}
			return err
		}
		kind := head[0]
		id := binary.LittleEndian.Uint32(head[1:5])
		n := binary.LittleEndian.Uint32(head[5:9])
		payload := make([]byte, n)
		if _, err := io.ReadFull(r, payload); err != nil {
			return err
		}
		switch kind {
		case kindGrant, kindBody, kindRefuse:
		case kindAllow:
			if len(payload) != allowanceLen {
				return fmt.Errorf("allowance frame of %d bytes", len(payload))
			}
			c.setAllowance(payload)
			continue
		default:
			return fmt.Errorf("unknown control frame %q", kind)
		}
		c.mu.Lock()
		ch, ok := c.pending[id]
		delete(c.pending, id)
		c.mu.Unlock()
		if ok { // else its client left first; the sidecar has been told
			ch <- reply{kind, payload}
		}
	}
}

func (c *control) setAllowance(p []byte) {
	seen := binary.LittleEndian.Uint32(p[0:4])
	c.mu.Lock()
	defer c.mu.Unlock()
	a := &c.allow
	ahead := int(a.sent - seen) // sent after the sidecar's count: still to subtract
	if ahead < 0 {
		ahead = 0
	}
	if ahead < len(a.outstanding) {
		a.outstanding = append(a.outstanding[:0], a.outstanding[len(a.outstanding)-ahead:]...)
	}
	a.seen = seen
	a.count = int(binary.LittleEndian.Uint32(p[4:8]))
	a.blocks = int(binary.LittleEndian.Uint32(p[8:12]))
	a.tokPerByte = math.Float64frombits(binary.LittleEndian.Uint64(p[12:20]))
	a.blockSize = int(binary.LittleEndian.Uint32(p[20:24]))
	a.priority = int(int32(binary.LittleEndian.Uint32(p[24:28])))
}

// blockSize is the engine's KV block size as the sidecar last said (16 before).
func (c *control) blockSize() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.allow.blockSize > 0 {
		return c.allow.blockSize
	}
	return 16
}

// trySend takes a request of maxTokens output tokens inside the allowance when it
// fits and no arrival awaits a reply; it then tells the sidecar ('S') and returns
// the priority to send it with.
func (c *control) trySend(id uint32, route byte, body []byte, maxTokens int) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	a := &c.allow
	if len(c.pending) > 0 || a.count <= len(a.outstanding) || a.blockSize <= 0 {
		return 0, false
	}
	tokens := int(math.Ceil(float64(len(body))*a.tokPerByte)) + maxTokens
	blocks := (tokens + a.blockSize - 1) / a.blockSize
	used := 0
	for _, b := range a.outstanding {
		used += b
	}
	if used+blocks > a.blocks {
		return 0, false
	}
	a.outstanding = append(a.outstanding, blocks)
	a.sent++
	frame := make([]byte, headerLen+1+len(body))
	putHeader(frame, kindSent, id, 1+len(body))
	frame[headerLen] = route
	copy(frame[headerLen+1:], body)
	c.out <- frame // in order: an arrival queued after this lock comes after it
	return a.priority, true
}

// arrive registers request id and tells the sidecar; the reply comes on the channel.
func (c *control) arrive(id uint32, route byte, body []byte) chan reply {
	ch := make(chan reply, 1)
	c.mu.Lock()
	c.pending[id] = ch
	c.mu.Unlock()
	frame := make([]byte, headerLen+1+len(body))
	putHeader(frame, kindArrival, id, 1+len(body))
	frame[headerLen] = route
	copy(frame[headerLen+1:], body)
	c.out <- frame
	return ch
}

// forget drops a request still waiting for its reply (its client went away).
func (c *control) forget(id uint32) {
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
}

// progress reports the tokens seen so far, the TTFT (negative: not in this
// read) and the gaps before each further token event of this read.
func (c *control) progress(id uint32, seen uint32, ttft float64, gaps []float64) {
	frame := make([]byte, headerLen+12+8*len(gaps))
	putHeader(frame, kindProgress, id, 12+8*len(gaps))
	p := frame[headerLen:]
	binary.LittleEndian.PutUint32(p, seen)
	binary.LittleEndian.PutUint64(p[4:], math.Float64bits(ttft))
	for i, g := range gaps {
		binary.LittleEndian.PutUint64(p[12+8*i:], math.Float64bits(g))
	}
	c.out <- frame
}

// end reports how a granted (or abandoned) request finished.
func (c *control) end(id uint32, outcome byte, tokens uint32, e2e, toEngine, relay float64) {
	frame := make([]byte, headerLen+29)
	putHeader(frame, kindEnd, id, 29)
	p := frame[headerLen:]
	p[0] = outcome
	binary.LittleEndian.PutUint32(p[1:], tokens)
	binary.LittleEndian.PutUint64(p[5:], math.Float64bits(e2e))
	binary.LittleEndian.PutUint64(p[13:], math.Float64bits(toEngine))
	binary.LittleEndian.PutUint64(p[21:], math.Float64bits(relay))
	c.out <- frame
}

func putHeader(frame []byte, kind byte, id uint32, n int) {
	frame[0] = kind
	binary.LittleEndian.PutUint32(frame[1:5], id)
	binary.LittleEndian.PutUint32(frame[5:9], uint32(n))
}

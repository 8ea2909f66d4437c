package main

// The control link to the sidecar's Python process: one Unix stream socket
// carrying length-prefixed frames both ways (docs/sidecar.md, "The compiled
// front"). Every frame is a 9-byte header, the frame's kind, the request's id
// and the payload's length (little-endian), then the payload.
//
// front -> sidecar: 'A' arrival (route byte + the client's body), 'P' progress
// (tokens seen, TTFT when this read held the first token, then the token gaps),
// 'E' end (outcome, tokens, end-to-end, time to the engine, first relay write).
// sidecar -> front: 'G' grant (vLLM priority), 'B' grant with a rewritten body,
// 'R' refusal (HTTP status + an error body in vLLM's shape).

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
)

// Outcomes of an 'E' frame.
const (
	outcomeOK          = 'o'
	outcomeEngineError = 'e'
	outcomeCancelled   = 'c'
)

// reply is the sidecar's answer to one arrival.
type reply struct {
	kind    byte
	payload []byte
}

type control struct {
	conn    net.Conn
	out     chan []byte
	mu      sync.Mutex
	pending map[uint32]chan reply
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
